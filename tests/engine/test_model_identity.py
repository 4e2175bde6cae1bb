"""The model identity (part of every result key) on folders touched by macOS: Finder's ``.DS_Store`` and the
AppleDouble ``._*`` files written to non-Apple volumes are not the model, so they change no key (#16)."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx

from mlxbatch.engine import ModelSpec, load_model

APPLEDOUBLE = b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        " + bytes(4000)  # a resource-fork sidecar


def make_adapter(folder, tiny_model_path, seed: int):
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load as mlx_load

    cfg = {"fine_tune_type": "lora", "num_layers": 2,
           "lora_parameters": {"rank": 4, "scale": 20.0, "dropout": 0.0, "keys": ["self_attn.q_proj"]}}
    model, _ = mlx_load(str(tiny_model_path))
    linear_to_lora_layers(model, cfg["num_layers"], cfg["lora_parameters"])
    mx.random.seed(seed)
    weights = {k: mx.random.normal(v.shape) * 0.1 for k, v in tree_flatten(model.trainable_parameters())
               if k.rsplit(".", 1)[-1] in ("lora_a", "lora_b")}
    folder.mkdir()
    mx.save_safetensors(str(folder / "adapters.safetensors"), weights)
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    return folder


def test_ds_store_and_appledouble_files_leave_the_identity_alone(tmp_path, tiny_model_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_path, model)
    adapter = make_adapter(tmp_path / "adapter", tiny_model_path, seed=1)
    spec = ModelSpec(str(model), adapter_path=str(adapter))
    before = load_model(spec).identity
    weights = sorted(p.name for p in model.glob("*.safetensors"))
    for name in [".DS_Store", *(f"._{w}" for w in weights)]:  # what a Mac leaves on an exFAT / SMB volume
        (model / name).write_bytes(APPLEDOUBLE)
    (adapter / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1" + bytes(6000))
    (adapter / "._adapters.safetensors").write_bytes(APPLEDOUBLE)
    after = load_model(spec)  # mlx-lm's own weight glob skips them too: the model still loads
    assert after.identity == before
    # a real change still changes it: other adapter weights, another key
    shutil.rmtree(adapter)
    make_adapter(adapter, tiny_model_path, seed=2)
    assert load_model(spec).identity != before
