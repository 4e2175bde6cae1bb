"""Vision-language rows in the engine (issue #6): a tiny random Qwen2-VL loaded through mlx-vlm, images made here; and
tiny random Qwen2.5-VL (window attention in its vision tower) and Qwen3-VL (deepstack features added inside the
language model) held to mlx-vlm's own generation the same way.

Every comparison is greedy float32 token for token unless said otherwise.
"""

from __future__ import annotations

import pytest

pytest.importorskip("mlx_vlm")

from mlxbatch import InvalidRequestError, SamplingParams  # noqa: E402
from mlxbatch.engine import Engine, EngineConfig  # noqa: E402
from mlxbatch.engine.sched.blocks import block_hashes  # noqa: E402
from mlxbatch.io.images import pixel_hash  # noqa: E402
from mlxbatch.models.random_vlm import synthetic_image  # noqa: E402
from mlxbatch.types import ImageInput  # noqa: E402

ASK = [{"role": "user", "content": "What is in this picture? Answer with a few words."}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, logprobs=0)


def picture(seed: int, width: int = 112, height: int = 112) -> ImageInput:
    img = synthetic_image(seed, width, height)
    return ImageInput(img, pixel_hash(img), f"picture-{seed}.png")


def make_engine(loaded, **kw) -> Engine:
    cfg = dict(max_num_seqs=8, prefill_chunk_size=16, max_num_batched_tokens=64, seed=0)
    cfg.update(kw)
    return Engine(loaded, EngineConfig(**cfg))


def run(engine: Engine, rows, params=GREEDY):
    """Submit every (prompt, images, params) row, step until all finished; outputs in row order."""
    core = engine.core
    ids = []
    for i, row in enumerate(rows):
        prompt, images = row[0], row[1]
        p = row[2] if len(row) > 2 else params
        ids.append(core.add_request(prompt, p, request_id=f"row{i}", images=images))
    done = {o.request_id: o for o in core.run_until_done()}
    return [done[i] for i in ids]


def one_at_a_time(loaded, rows, params=GREEDY):
    with make_engine(loaded, max_num_seqs=1, prefix_cache=False) as eng:
        return [run(eng, [row], params)[0] for row in rows]


def mixed_rows():
    a, b, c = picture(1), picture(2, 140, 84), picture(3, 56, 56)
    return [
        (ASK, [a]),
        (ASK, [b]),
        ("Describe the picture.", [c]),  # a plain string with images goes through the chat template
        (ASK, [a, b]),  # two images in one row
        ("def main():\n    return", []),  # a text row of the same model, in the same batch
        ([{"role": "user", "content": "Name a colour."}], []),
        (ASK, [a]),  # the first row again
    ]


def test_tiny_vlm_loads_through_mlx_vlm(tiny_vlm_path, tiny_vlm_loaded):
    import mlx_vlm

    model, processor = mlx_vlm.load(str(tiny_vlm_path))
    assert model.config.model_type == "qwen2_vl" and processor.image_token == "<|image_pad|>"
    assert tiny_vlm_loaded.vlm is not None and tiny_vlm_loaded.dtype == "float32"


def test_different_images_give_different_outputs(tiny_vlm_loaded):
    with make_engine(tiny_vlm_loaded) as eng:
        outs = run(eng, [(ASK, [picture(s)]) for s in (1, 2, 3)])
    texts = {o.token_ids for o in outs}
    assert len(texts) == 3, [o.token_ids for o in outs]


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_batched_equals_one_at_a_time(tiny_vlm_loaded, prefix_cache):
    rows = mixed_rows()
    ref = one_at_a_time(tiny_vlm_loaded, rows)
    with make_engine(tiny_vlm_loaded, prefix_cache=prefix_cache) as eng:
        got = run(eng, rows)
        stats = eng.stats()["vision_cache"]
    for r, g in zip(ref, got):
        assert g.token_ids == r.token_ids
        assert g.prompt_tokens == r.prompt_tokens
        assert max(abs(x.logprob - y.logprob) for x, y in zip(g.logprobs, r.logprobs)) < 1e-3
    assert got[0].token_ids == got[-1].token_ids  # the repeated row
    assert stats["images_encoded"] == 3 and stats["hits"] >= 2  # a, b, c once each; a and b again later


def test_matches_mlx_vlm_generate(tiny_vlm_loaded):
    """mlx-vlm's own one-at-a-time generation is the reference: same tokens, same log-probabilities."""
    matches_mlx_vlm(tiny_vlm_loaded, [(ASK, [picture(1)]), (ASK, [picture(2, 140, 84)]), (ASK, [picture(3)]),
                                      (ASK, [picture(4), picture(5, 56, 84)])])


@pytest.fixture(scope="module")
def tiny_vl25_loaded(tiny_vl25_path):
    from mlxbatch.engine import ModelSpec, load_model

    return load_model(ModelSpec(str(tiny_vl25_path)))


@pytest.fixture(scope="module")
def tiny_vl3_loaded(tiny_vl3_path):
    from mlxbatch.engine import ModelSpec, load_model

    return load_model(ModelSpec(str(tiny_vl3_path)))


@pytest.fixture(scope="module")
def tiny_vl3moe_loaded(tiny_vl3moe_path):
    from mlxbatch.engine import ModelSpec, load_model

    return load_model(ModelSpec(str(tiny_vl3moe_path)))


@pytest.mark.parametrize("model, model_type", [("tiny_vl25_loaded", "qwen2_5_vl"), ("tiny_vl3_loaded", "qwen3_vl"),
                                               ("tiny_vl3moe_loaded", "qwen3_vl_moe")])
def test_newer_qwen_vl_rows_match_mlx_vlm_alone_and_in_a_batch(model, model_type, request):
    """Qwen2.5-VL: its vision tower attends within windows (block 0) and over the whole image (block 1). Qwen3-VL:
    its tower's deepstack level is added to the language model's hidden states at the image's positions after the
    first layer, so each forward carries the slice of it its rows' image positions cover (without it the tokens
    part from mlx-vlm's); Qwen3-VL-MoE the same with mixture-of-experts text layers. Rows of several images and sizes, batched with a text row, prefilled in chunks of 16 tokens
    (images cut across chunks) and through the prefix cache, give mlx-vlm's own tokens and logprobs."""
    loaded = request.getfixturevalue(model)
    assert loaded.vlm.model_type == model_type
    assert loaded.context_length == (8192 if model_type.startswith("qwen3") else 4096)  # (Qwen3-VL's: its text config's)
    rows = [(ASK, [picture(1)]), (ASK, [picture(2, 140, 84)]), (ASK, [picture(7)]),
            (ASK, [picture(4), picture(5, 56, 84)]), ("def main():\n    return", []), (ASK, [picture(1)])]
    got = matches_mlx_vlm(loaded, rows)
    # rows 0 and 2 have the same prompt tokens (two 112x112 pictures): what each picture shows changes the text
    assert got[0].token_ids != got[2].token_ids and got[0].token_ids == got[-1].token_ids


def matches_mlx_vlm(loaded, rows):
    """The engine's outputs of ``rows`` (one batch, prefix cache on), each equal to mlx-vlm's ``stream_generate`` of
    the row alone (a text row: to the engine's own run of it alone)."""
    from mlx_vlm import stream_generate

    vlm = loaded.vlm
    with make_engine(loaded) as eng:
        got = run(eng, rows)
    for row, g in zip(rows, got):
        prompt, images = row
        if not images:
            assert g.token_ids == one_at_a_time(loaded, [row])[0].token_ids
            continue
        ref = list(stream_generate(vlm.model, vlm.processor, vlm.render(prompt, len(images)),
                                   image=[im.image for im in images], max_tokens=GREEDY.max_tokens, temperature=0.0))
        ref_tokens = [int(r.token) for r in ref]
        ref_logprobs = [float(r.logprobs[r.token]) for r in ref]
        n = len(g.token_ids)
        assert list(g.token_ids) == ref_tokens[:n] and (n == len(ref_tokens) or n == GREEDY.max_tokens)
        assert max(abs(x.logprob - y) for x, y in zip(g.logprobs, ref_logprobs)) < 1e-3
    return got


def test_repeated_image_hits_the_vision_cache(tiny_vlm_loaded):
    a = picture(7)
    same_pixels = ImageInput(a.image.copy(), pixel_hash(a.image.copy()), "copy.png")
    with make_engine(tiny_vlm_loaded) as eng:
        first = run(eng, [(ASK, [a])])[0]
        st = eng.stats()["vision_cache"]
        assert (st["misses"], st["hits"], st["images_encoded"]) == (1, 0, 1)
        again = run(eng, [(ASK, [same_pixels]), ([{"role": "user", "content": "And now?"}], [a])])
        st = eng.stats()["vision_cache"]
    assert again[0].token_ids == first.token_ids
    assert (st["misses"], st["hits"], st["images_encoded"]) == (1, 2, 1)
    assert st["encoder_s_saved"] > 0 and st["held_requests"] == 0


def test_two_rows_with_one_new_image_encode_it_once(tiny_vlm_loaded):
    a = picture(8)
    with make_engine(tiny_vlm_loaded, prefill_chunk_size=512, max_num_batched_tokens=512) as eng:
        outs = run(eng, [(ASK, [a]), (ASK, [a])])
        st = eng.stats()["vision_cache"]
    assert outs[0].token_ids == outs[1].token_ids
    assert st["images_encoded"] == 1 and st["hits"] == 1


def test_seeded_sampling_same_alone_and_in_a_batch(tiny_vlm_loaded):
    sampled = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12)
    target = (ASK, [picture(2, 140, 84)], sampled)
    alone = one_at_a_time(tiny_vlm_loaded, [target])[0]
    others = [(ASK, [picture(s)]) for s in (1, 3)] + [("x = [1, 2, 3]", [])]
    with make_engine(tiny_vlm_loaded) as eng:
        batched = run(eng, [others[0], target, *others[1:]])[1]
    assert batched.token_ids == alone.token_ids
    greedy = one_at_a_time(tiny_vlm_loaded, [(ASK, [picture(2, 140, 84)])])[0]
    assert alone.token_ids != greedy.token_ids[: len(alone.token_ids)]  # the sampling parameters were honoured


def test_prefix_cache_keys_image_positions_by_content(tiny_vlm_loaded):
    """Same placeholder tokens, different pictures: no KV shared from the image on; the same picture: shared."""
    tail = " is what the picture shows, described in one careful sentence of plain words for a reader."
    prompt = "<|vision_start|><|image_pad|><|vision_end|>" + tail  # placeholders given: raw text, image first
    a, b = picture(11), picture(12)  # same size: the same token ids
    with make_engine(tiny_vlm_loaded, max_num_seqs=1) as eng:
        out_a, out_b, out_a2 = (run(eng, [(prompt, [im])])[0] for im in (a, b, a))
    assert out_b.cached_tokens == 0  # the image sits in the first block: nothing of A's KV fits B
    assert out_a2.cached_tokens >= 16 * ((out_a.prompt_tokens - 1) // 16) > 0
    with make_engine(tiny_vlm_loaded, max_num_seqs=1, prefix_cache=False) as eng:
        ref = [run(eng, [(prompt, [im])])[0] for im in (a, b)]
    assert (out_a.token_ids, out_b.token_ids, out_a2.token_ids) == (ref[0].token_ids, ref[1].token_ids,
                                                                     ref[0].token_ids)
    assert out_a.token_ids != out_b.token_ids
    tokens = list(range(40))
    assert block_hashes(tokens, 16, [(1, a.content_hash)]) != block_hashes(tokens, 16, [(1, b.content_hash)])
    assert block_hashes(tokens, 16, [(20, a.content_hash)])[0] == block_hashes(tokens, 16)[0]


@pytest.mark.parametrize("model", ["tiny_vlm_loaded", "tiny_vl25_loaded", "tiny_vl3_loaded"])
def test_an_image_marker_in_the_text_places_each_image_there(model, request):
    """``<image>`` in a user's text is where the next image goes (without one, mlx-vlm's chat helper puts the images
    after the text for Qwen2-VL, before it for Qwen2.5-VL); the marker is never left in the text the model sees."""
    loaded = request.getfixturevalue(model)
    vlm = loaded.vlm
    a, b = picture(1), picture(2, 140, 84)
    marked = [{"role": "user", "content": "Compare <image> with <image>: which is brighter?"}]
    text = vlm.render(marked, 2)
    assert "<image>" not in text and text.count("<|vision_start|>") == 2
    assert "Compare <|vision_start|>" in text and "<|vision_end|> with <|vision_start|>" in text
    assert text != vlm.render([{"role": "user", "content": "Compare with : which is brighter?"}], 2)
    # the engine's rows (images in place, in a batch) give mlx-vlm's own generation of the same text and images
    matches_mlx_vlm(loaded, [(marked, [a, b]), ("<image>Describe it.", [a]), (ASK, [a, b])])
    with make_engine(loaded) as eng, pytest.raises(InvalidRequestError, match=r"1 <image> placeholder\(s\) for 2"):
        eng.core.add_request([{"role": "user", "content": "Only <image> here."}], GREEDY, images=[a, b])


def test_a_vision_language_architecture_not_supported_is_refused_at_load(tiny_vl25_path, tmp_path):
    """Another mlx-vlm architecture (its own position rules) is refused with the supported ones named, not run wrong."""
    import json
    import shutil

    from mlxbatch.engine import ModelSpec, load_model
    from mlxbatch.errors import ModelLoadError

    other = tmp_path / "gemma3-like"
    shutil.copytree(tiny_vl25_path, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "gemma3"}))
    with pytest.raises(ModelLoadError, match="'gemma3' is not supported.*qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe"):
        load_model(ModelSpec(str(other)))


def test_text_only_model_refuses_images(tiny_loaded):
    with Engine(tiny_loaded, EngineConfig(max_num_seqs=2)) as eng:
        with pytest.raises(InvalidRequestError, match="picture-1.png.*text-only"):
            eng.core.add_request("Describe.", GREEDY, images=[picture(1)])
        assert not eng.core.has_unfinished


def test_placeholders_must_match_images(tiny_vlm_loaded):
    with make_engine(tiny_vlm_loaded) as eng:
        with pytest.raises(InvalidRequestError, match="placeholder"):
            eng.core.add_request("<|vision_start|><|image_pad|><|vision_end|> two?", GREEDY,
                                 images=[picture(1), picture(2)])
        out = run(eng, [(ASK, [picture(1)])])[0]  # the engine goes on
    assert out.generated_tokens == GREEDY.max_tokens


def test_engine_generate_takes_images_per_prompt(tiny_vlm_loaded):
    rows = mixed_rows()
    with make_engine(tiny_vlm_loaded) as eng:
        outs = eng.generate([r[0] for r in rows], GREEDY, images=[r[1] for r in rows])
        with pytest.raises(InvalidRequestError, match="one image list per prompt"):
            eng.generate([ASK], GREEDY, images=[])
    ref = one_at_a_time(tiny_vlm_loaded, rows)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]


class FlakyVLM:
    """The real mlx-vlm model, except that the third decode forward over more than ``limit`` rows fails like an
    allocation (the engine then preempts the newest rows and recomputes them: prompt, images and generated tokens)."""

    def __init__(self, vlm, limit: int) -> None:
        self._vlm, self._limit, self.failures, self.decodes = vlm, limit, 0, 0

    def body(self, inputs, embeds, cache, positions, deepstack=None):
        if inputs.shape[1] == 1 and inputs.shape[0] > self._limit:
            self.decodes += 1
        if self.decodes == 3 and self.failures == 0:
            self.failures += 1
            raise RuntimeError("[malloc] Attempting to allocate 9999999999 bytes: out of memory")
        return self._vlm.body(inputs, embeds, cache, positions, deepstack=deepstack)

    def __getattr__(self, name):
        return getattr(self._vlm, name)


def test_out_of_memory_preempts_image_rows_and_loses_nothing(tiny_vlm_loaded):
    import dataclasses

    rows = mixed_rows()
    expected = one_at_a_time(tiny_vlm_loaded, rows)
    flaky = FlakyVLM(tiny_vlm_loaded.vlm, limit=4)
    with make_engine(dataclasses.replace(tiny_vlm_loaded, vlm=flaky), prefill_chunk_size=512,
                     max_num_batched_tokens=1024) as eng:
        got = run(eng, rows)
        assert flaky.failures == 1 and eng.stats()["preemptions"] == 1
        assert eng.stats()["vision_cache"]["held_requests"] == 0
    assert [g.token_ids for g in got] == [e.token_ids for e in expected]


def test_a_4_bit_checkpoint_made_by_mlx_vlm_runs_as_mlx_vlm_runs_it(tiny_vl3_path, tmp_path):
    """The checkpoints Macs run are mlx-vlm's quantized conversions (mlx-community's 4-bit VLMs): one made by
    ``mlx_vlm.convert`` loads (dequantized on a CPU, as text checkpoints are; kept 4-bit on a GPU) and its rows give the
    tokens of mlx-vlm's own generation with its quantized kernels."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_vlm import convert, load, stream_generate

    from mlxbatch.engine import ModelSpec, load_model

    q4 = tmp_path / "q4"
    convert(str(tiny_vl3_path), str(q4), quantize=True, q_group_size=64, q_bits=4, trust_remote_code=False)
    loaded = load_model(ModelSpec(str(q4)))
    quantized = any(isinstance(m, nn.QuantizedLinear) for _, m in loaded.vlm.model.named_modules())
    assert quantized == (mx.default_device() != mx.cpu)
    ref_model, ref_processor = load(str(q4))
    rows = [(ASK, [picture(1)]), (ASK, [picture(7)]), (ASK, [picture(2, 140, 84)])]
    with make_engine(loaded) as eng:
        got = run(eng, rows)
    for (prompt, images), g in zip(rows, got):
        ref = [int(r.token) for r in stream_generate(ref_model, ref_processor, loaded.vlm.render(prompt, len(images)),
                                                     image=[im.image for im in images],
                                                     max_tokens=GREEDY.max_tokens, temperature=0.0)]
        assert list(g.token_ids) == ref[:len(g.token_ids)]
    assert got[0].token_ids != got[1].token_ids  # the pictures still tell apart after quantization
