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
MCQ = [  # (question, the right answer, three wrong ones): easy general knowledge
    ("What is the capital of France?", "Paris", ["Berlin", "Madrid", "Rome"]),
    ("What is the capital of Japan?", "Tokyo", ["Seoul", "Beijing", "Bangkok"]),
    ("What is the capital of Italy?", "Rome", ["Milan", "Naples", "Venice"]),
    ("What is the capital of Spain?", "Madrid", ["Lisbon", "Barcelona", "Seville"]),
    ("What is the capital of Germany?", "Berlin", ["Munich", "Vienna", "Hamburg"]),
    ("What is the capital of England?", "London", ["Dublin", "Manchester", "Paris"]),
    ("What is the capital of Russia?", "Moscow", ["Kiev", "Warsaw", "Minsk"]),
    ("What is the capital of China?", "Beijing", ["Shanghai", "Tokyo", "Hong Kong"]),
    ("What is the capital of Egypt?", "Cairo", ["Nairobi", "Tunis", "Athens"]),
    ("What is the capital of the United States?", "Washington", ["New York", "Los Angeles", "Chicago"]),
    ("What is the capital of Canada?", "Ottawa", ["Toronto", "Vancouver", "Chicago"]),
    ("What is the capital of Greece?", "Athens", ["Sparta", "Rome", "Istanbul"]),
    ("In which country is the Eiffel Tower?", "France", ["Italy", "Germany", "Spain"]),
    ("In which country are the pyramids of Giza?", "Egypt", ["Mexico", "Peru", "India"]),
    ("In which city is the Statue of Liberty?", "New York", ["Boston", "Paris", "London"]),
    ("Which is the largest ocean on Earth?", "The Pacific Ocean", ["The Atlantic Ocean", "The Indian Ocean", "The Arctic Ocean"]),
    ("Which is the largest planet in the solar system?", "Jupiter", ["Mars", "Venus", "Mercury"]),
    ("Which planet is known as the Red Planet?", "Mars", ["Venus", "Saturn", "Neptune"]),
    ("Which planet do we live on?", "Earth", ["Mars", "Jupiter", "Pluto"]),
    ("What is the closest star to the Earth?", "The Sun", ["The Moon", "Mars", "Polaris"]),
    ("What goes around the Earth about once a month?", "The Moon", ["The Sun", "Mars", "A comet"]),
    ("How many days are in a week?", "Seven", ["Five", "Six", "Ten"]),
    ("How many months are in a year?", "Twelve", ["Ten", "Eleven", "Fourteen"]),
    ("How many hours are in a day?", "24", ["12", "30", "60"]),
    ("How many minutes are in an hour?", "60", ["100", "30", "24"]),
    ("How many seconds are in a minute?", "60", ["100", "10", "30"]),
    ("How many days are in a leap year?", "366", ["365", "360", "400"]),
    ("How many legs does a spider have?", "Eight", ["Six", "Four", "Ten"]),
    ("How many legs does an insect have?", "Six", ["Eight", "Four", "Ten"]),
    ("How many legs does a dog have?", "Four", ["Two", "Six", "Eight"]),
    ("How many legs does a bird have?", "Two", ["Four", "Six", "Three"]),
    ("How many sides does a triangle have?", "Three", ["Four", "Five", "Six"]),
    ("How many sides does a square have?", "Four", ["Three", "Five", "Six"]),
    ("How many sides does a hexagon have?", "Six", ["Five", "Seven", "Eight"]),
    ("How many continents are there?", "Seven", ["Five", "Six", "Nine"]),
    ("What is two plus two?", "Four", ["Three", "Five", "Six"]),
    ("What is ten minus three?", "Seven", ["Six", "Eight", "Thirteen"]),
    ("What is five times two?", "Ten", ["Seven", "Twelve", "Three"]),
    ("What is half of ten?", "Five", ["Two", "Four", "Twenty"]),
    ("Which number is the largest?", "100", ["10", "50", "99"]),
    ("What colour is the sky on a clear day?", "Blue", ["Green", "Red", "Black"]),
    ("What colour is grass?", "Green", ["Blue", "Purple", "Orange"]),
    ("What colour is snow?", "White", ["Black", "Green", "Red"]),
    ("What colour is a ripe banana?", "Yellow", ["Blue", "Purple", "Black"]),
    ("What colour is coal?", "Black", ["White", "Yellow", "Pink"]),
    ("What colour is blood?", "Red", ["Blue", "Green", "Yellow"]),
    ("Which colour do you get by mixing blue and yellow?", "Green", ["Purple", "Orange", "Red"]),
    ("Which colour do you get by mixing red and white?", "Pink", ["Green", "Blue", "Black"]),
    ("What is frozen water called?", "Ice", ["Steam", "Fog", "Rain"]),
    ("At what temperature in Celsius does water freeze?", "0 degrees", ["100 degrees", "50 degrees", "-40 degrees"]),
    ("At what temperature in Celsius does water boil at sea level?", "100 degrees", ["0 degrees", "50 degrees", "200 degrees"]),
    ("Which gas do humans need to breathe to live?", "Oxygen", ["Helium", "Carbon monoxide", "Neon"]),
    ("Which gas do plants take from the air to make food?", "Carbon dioxide", ["Oxygen", "Helium", "Hydrogen"]),
    ("What do plants need from the Sun to grow?", "Light", ["Sound", "Salt", "Wind"]),
    ("What do bees make?", "Honey", ["Milk", "Silk", "Butter"]),
    ("What do cows give us to drink?", "Milk", ["Honey", "Coffee", "Juice"]),
    ("Which animal says moo?", "A cow", ["A dog", "A cat", "A duck"]),
    ("Which animal barks?", "A dog", ["A cat", "A cow", "A fish"]),
    ("Which animal meows?", "A cat", ["A dog", "A horse", "A sheep"]),
    ("Which animal is the largest mammal?", "The blue whale", ["The elephant", "The giraffe", "The horse"]),
    ("Which animal is known as the king of the jungle?", "The lion", ["The mouse", "The rabbit", "The sheep"]),
    ("Which animal has a very long neck?", "The giraffe", ["The pig", "The dog", "The rabbit"]),
    ("Which animal has a trunk?", "The elephant", ["The lion", "The zebra", "The cat"]),
    ("Which animal lives in water and breathes with gills?", "A fish", ["A dog", "A bird", "A horse"]),
    ("Which animal can fly?", "A bird", ["A cow", "A dog", "A fish"]),
    ("What does a caterpillar turn into?", "A butterfly", ["A spider", "A bee", "A frog"]),
    ("What is a baby dog called?", "A puppy", ["A kitten", "A calf", "A foal"]),
    ("What is a baby cat called?", "A kitten", ["A puppy", "A lamb", "A chick"]),
    ("What do you call a baby sheep?", "A lamb", ["A kitten", "A cub", "A piglet"]),
    ("What do pandas mostly eat?", "Bamboo", ["Meat", "Fish", "Rice"]),
    ("What do you use to see?", "Your eyes", ["Your ears", "Your nose", "Your feet"]),
    ("What do you use to hear?", "Your ears", ["Your eyes", "Your hands", "Your knees"]),
    ("What do you use to smell?", "Your nose", ["Your ears", "Your elbows", "Your toes"]),
    ("Which organ pumps blood around the body?", "The heart", ["The lungs", "The stomach", "The brain"]),
    ("Which organ do we think with?", "The brain", ["The heart", "The liver", "The skin"]),
    ("Which organ do we breathe with?", "The lungs", ["The heart", "The kidneys", "The stomach"]),
    ("How many fingers are on one human hand?", "Five", ["Four", "Six", "Ten"]),
    ("What is the opposite of hot?", "Cold", ["Warm", "Big", "Fast"]),
    ("What is the opposite of big?", "Small", ["Tall", "Heavy", "Wide"]),
    ("What is the opposite of up?", "Down", ["Left", "Over", "Next"]),
    ("What is the opposite of day?", "Night", ["Morning", "Week", "Sun"]),
    ("What is the opposite of happy?", "Sad", ["Glad", "Funny", "Kind"]),
    ("What is the opposite of fast?", "Slow", ["Quick", "Loud", "Long"]),
    ("What is the opposite of open?", "Closed", ["Wide", "Empty", "Full"]),
    ("What is the opposite of old?", "Young", ["Ancient", "Tired", "Strong"]),
    ("Which season comes after winter?", "Spring", ["Autumn", "Summer", "Winter"]),
    ("Which is the coldest season?", "Winter", ["Summer", "Spring", "Autumn"]),
    ("Which day comes after Monday?", "Tuesday", ["Sunday", "Friday", "Thursday"]),
    ("Which month comes after January?", "February", ["March", "December", "June"]),
    ("Which is the first month of the year?", "January", ["March", "June", "December"]),
    ("What do you use to write on paper?", "A pen", ["A spoon", "A shoe", "A plate"]),
    ("What do you use to cut paper?", "Scissors", ["A spoon", "A pillow", "A cup"]),
    ("What do you wear on your feet?", "Shoes", ["Gloves", "Hats", "Scarves"]),
    ("What do you wear on your head to keep warm?", "A hat", ["Socks", "Shoes", "A belt"]),
    ("Where do you sleep at night?", "In a bed", ["In an oven", "In a sink", "In a bath"]),
    ("What do you use to tell the time?", "A clock", ["A spoon", "A chair", "A ladder"]),
    ("Which instrument has 88 keys?", "The piano", ["The guitar", "The violin", "The flute"]),
    ("How many strings does a standard guitar have?", "Six", ["Four", "Eight", "Twelve"]),
    ("Which sport is played with a round ball and two goals, mostly with the feet?", "Football", ["Tennis", "Golf", "Chess"]),
    ("Which game is played on a board with kings, queens and pawns?", "Chess", ["Poker", "Tennis", "Football"]),
    ("Who wrote Romeo and Juliet?", "William Shakespeare", ["Charles Dickens", "Mark Twain", "Jane Austen"]),
    ("Who painted the Mona Lisa?", "Leonardo da Vinci", ["Pablo Picasso", "Vincent van Gogh", "Claude Monet"]),
    ("Who was the first person to walk on the Moon?", "Neil Armstrong", ["Yuri Gagarin", "Albert Einstein", "Isaac Newton"]),
    ("Who developed the theory of relativity?", "Albert Einstein", ["Isaac Newton", "Charles Darwin", "Galileo Galilei"]),
    ("Which language is spoken in Brazil?", "Portuguese", ["Spanish", "French", "Italian"]),
    ("Which language is mainly spoken in Mexico?", "Spanish", ["Portuguese", "English", "German"]),
    ("What is the main language of France?", "French", ["German", "Spanish", "English"]),
    ("What currency is used in the United States?", "The dollar", ["The euro", "The yen", "The pound"]),
    ("What currency is used in Japan?", "The yen", ["The dollar", "The euro", "The rupee"]),
    ("What is the tallest mountain in the world?", "Mount Everest", ["Mont Blanc", "Mount Fuji", "Kilimanjaro"]),
    ("What is the longest river in Africa?", "The Nile", ["The Amazon", "The Thames", "The Danube"]),
    ("What is the largest desert in Africa?", "The Sahara", ["The Gobi", "The Alps", "The Amazon"]),
    ("What is H2O more commonly called?", "Water", ["Salt", "Sugar", "Air"]),
    ("What shape is the Earth?", "Round", ["Flat", "Square", "Triangular"]),
    ("Which metal is liquid at room temperature?", "Mercury", ["Iron", "Gold", "Copper"]),
    ("What is the hardest natural material?", "Diamond", ["Wood", "Glass", "Chalk"]),
    ("What force makes things fall to the ground?", "Gravity", ["Magnetism", "Friction", "Wind"]),
    ("Which fruit is known for keeping the doctor away?", "An apple", ["A lemon", "A melon", "A plum"]),
    ("What fruit is yellow and curved?", "A banana", ["An apple", "A grape", "A cherry"]),
    ("Which vegetable is orange and said to help you see in the dark?", "A carrot", ["A potato", "A pea", "An onion"]),
    ("What is bread mainly made from?", "Flour", ["Sugar", "Meat", "Rice"]),
    ("What do you call a person who treats sick people?", "A doctor", ["A pilot", "A baker", "A farmer"]),
    ("What do you call a person who flies a plane?", "A pilot", ["A chef", "A doctor", "A teacher"]),
    ("What do you call a person who teaches at a school?", "A teacher", ["A farmer", "A pilot", "A sailor"]),
    ("Where do fish live?", "In water", ["In trees", "In the desert", "In the sky"]),
]


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    rng = random.Random(20261129)
    rows = []
    for i in range(300):
        label = "positive" if rng.random() < 0.5 else "negative"
        text = rng.choice(POSITIVE if label == "positive" else NEGATIVE).format(p=rng.choice(PRODUCTS))
        rows.append({"id": f"review-{i:04d}", "review": text, "gold": label})
    (OUT / "reviews.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tickets = []
    for i in range(120):
        topic = rng.choice(sorted(TOPICS))
        tickets.append({"id": f"ticket-{i:04d}", "ticket": rng.choice(TOPICS[topic]), "gold": topic})
    (OUT / "tickets.jsonl").write_text("".join(json.dumps(r) + "\n" for r in tickets))
    (OUT / "mcq.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mcq_rows(random.Random(20261205))))


def mcq_rows(rng: random.Random) -> list[dict]:
    """The questions with their options in an order that gives nothing away: the right answer's position is
    balanced (a quarter at each of the four, shuffled) and the wrong answers are shuffled around it. ``choices``
    holds the options, each with the leading space that joins it to "Answer:" (lm-evaluation-harness's target
    delimiter: the candidates of a score job); the right one is ``label`` (its index) and ``answer`` (its text)."""
    positions = [i % 4 for i in range(len(MCQ))]
    rng.shuffle(positions)
    rows = []
    for i, ((question, right, wrong), pos) in enumerate(zip(MCQ, positions)):
        others = list(wrong)
        rng.shuffle(others)
        options = others[:pos] + [right] + others[pos:]
        rows.append({"id": f"q{i:03d}", "question": question, "choices": [" " + o for o in options], "label": pos,
                     "answer": right})
    return rows

if __name__ == "__main__":
    main()
