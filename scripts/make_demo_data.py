"""Writes the small datasets the example jobs use (jobs/data/*.jsonl). Deterministic; output is committed."""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "jobs" / "data"

PRODUCTS = ["headphones", "coffee maker", "laptop", "running shoes", "phone case", "desk lamp", "backpack",
            "blender", "keyboard", "water bottle", "tent", "vacuum cleaner", "e-reader", "office chair", "toaster"]
POSITIVE = ["I love this {p}, it works perfectly.", "The {p} is excellent and worth every penny.",
            "Great {p}! Fast delivery and superb quality.", "This {p} exceeded my expectations.",
            "Best {p} I have ever owned, highly recommended.", "The {p} is sturdy, well made and easy to use.",
            "Fantastic {p}, my whole family is happy with it.", "Really pleased with the {p}; it does the job well."]
NEGATIVE = ["The {p} broke after two days. Terrible.", "I hate this {p}, it stopped working immediately.",
            "Awful {p}, cheap materials and poor quality.", "The {p} arrived damaged and support never replied.",
            "Worst {p} I have bought. Do not waste your money.", "This {p} is a disappointment; it feels flimsy.",
            "Returned the {p} at once, it was useless.", "The {p} is noisy, slow and overpriced."]
TOPICS = {
    "billing": ["I was charged twice for my subscription this month.", "Can I get a refund for the annual plan?",
                "My invoice shows the wrong company address.", "The payment failed but money left my account."],
    "technical": ["The app crashes every time I open the settings page.", "I cannot log in after the update.",
                  "Export to PDF produces an empty file.", "Sync between my phone and laptop stopped working."],
    "shipping": ["My parcel has not arrived after three weeks.", "The tracking number does not work.",
                 "Can you deliver to a pick-up point instead of my home?", "The box arrived open and items are missing."],
    "account": ["How do I change the email address on my account?", "Please delete my account and my data.",
                "I forgot my password and the reset email never comes.", "Can I add a second user to my plan?"],
}
MCQ = [
    ("What is the capital of France?", ["Berlin", "Madrid", "Paris", "Rome"], "C"),
    ("What is the capital of Japan?", ["Tokyo", "Seoul", "Beijing", "Bangkok"], "A"),
    ("How many days are in a week?", ["Five", "Six", "Seven", "Eight"], "C"),
    ("Which planet is known as the Red Planet?", ["Venus", "Mars", "Jupiter", "Saturn"], "B"),
    ("What do bees make?", ["Milk", "Silk", "Honey", "Wax paper"], "C"),
    ("Which animal is the largest mammal?", ["Elephant", "Blue whale", "Giraffe", "Horse"], "B"),
    ("What is frozen water called?", ["Steam", "Ice", "Fog", "Rain"], "B"),
    ("Which colour do you get by mixing blue and yellow?", ["Green", "Purple", "Orange", "Red"], "A"),
    ("How many legs does a spider have?", ["Six", "Eight", "Ten", "Four"], "B"),
    ("What is the capital of Italy?", ["Rome", "Milan", "Naples", "Venice"], "A"),
    ("Which gas do plants absorb from the air?", ["Oxygen", "Nitrogen", "Carbon dioxide", "Helium"], "C"),
    ("What is the boiling point of water at sea level in Celsius?", ["50", "90", "100", "120"], "C"),
    ("Which ocean is the largest?", ["Atlantic", "Indian", "Arctic", "Pacific"], "D"),
    ("What is the capital of Spain?", ["Lisbon", "Madrid", "Barcelona", "Seville"], "B"),
    ("How many continents are there?", ["Five", "Six", "Seven", "Nine"], "C"),
    ("Which instrument has 88 keys?", ["Guitar", "Violin", "Piano", "Flute"], "C"),
]


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    rng = random.Random(20261129)
    rows = []
    for i in range(300):
        label = "positive" if rng.random() < 0.5 else "negative"
        text = rng.choice(POSITIVE if label == "positive" else NEGATIVE).format(p=rng.choice(PRODUCTS))
        rows.append({"id": f"review-{i:04d}", "text": text, "gold": label})
    (OUT / "reviews.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tickets = []
    for i in range(120):
        topic = rng.choice(sorted(TOPICS))
        tickets.append({"id": f"ticket-{i:04d}", "text": rng.choice(TOPICS[topic]), "gold": topic})
    (OUT / "tickets.jsonl").write_text("".join(json.dumps(r) + "\n" for r in tickets))
    mcq = [{"id": f"q{i:02d}", "question": q, "A": c[0], "B": c[1], "C": c[2], "D": c[3], "answer": a}
           for i, (q, c, a) in enumerate(MCQ)]
    (OUT / "mcq.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mcq))


if __name__ == "__main__":
    main()
