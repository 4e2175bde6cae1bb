"""Memory rules per device, with the platform, device facts and MLX calls injected (a Mac's branch runs here too)."""

from __future__ import annotations

from mlxbatch.config import EngineConfig
from mlxbatch.engine.model.memory import (
    GiB,
    HostMemory,
    MemoryLimits,
    default_kv_fraction,
    default_step_bytes,
    device_available,
    host_memory,
    plan_memory,
)
from mlxbatch.engine.sched.sizing import default_step_tokens

VM_STAT = """Mach Virtual Memory Statistics: (page size of 16384 bytes)
Pages free:                               10000.
Pages active:                            300000.
Pages inactive:                           50000.
Pages speculative:                         2000.
Pages throttled:                              0.
Pages wired down:                        200000.
Pages purgeable:                           1000.
"""


def test_host_memory_on_a_mac_counts_free_inactive_speculative_and_purgeable_pages():
    calls = []

    def read(cmd):
        calls.append(cmd)
        return str(16 * GiB) if cmd[0] == "sysctl" else VM_STAT

    host = host_memory("darwin", read)
    assert host == HostMemory(16 * GiB, (10000 + 50000 + 2000 + 1000) * 16384)
    assert ["vm_stat"] in calls and not any("/proc" in " ".join(c) for c in calls)


def test_host_memory_on_linux_reads_meminfo():
    host = host_memory("linux", lambda cmd: "MemTotal:       24000000 kB\nMemAvailable:   12000000 kB\n")
    assert host == HostMemory(24000000 * 1024, 12000000 * 1024)


def test_metal_available_memory_is_bounded_by_what_the_host_has_free():
    info = {"max_recommended_working_set_size": 11 * GiB, "memory_size": 16 * GiB}  # no free_memory on Metal
    total, avail = device_available("metal", info, HostMemory(16 * GiB, 3 * GiB), mlx_held=2 * GiB)
    assert total == 11 * GiB and avail == 3 * GiB  # the OS and other apps hold the rest of the RAM
    _, avail = device_available("metal", info, HostMemory(16 * GiB, 14 * GiB), mlx_held=2 * GiB)
    assert avail == 9 * GiB  # working set less what MLX holds (active + its buffer cache)
    total, avail = device_available("cuda", {"total_memory": 141 * GiB, "free_memory": 120 * GiB},
                                    HostMemory(128 * GiB, 100 * GiB), mlx_held=0)
    assert (total, avail) == (141 * GiB, 120 * GiB)


def test_small_macs_get_smaller_defaults():
    assert default_kv_fraction("metal", 16 * GiB) < default_kv_fraction("metal", 64 * GiB) == 0.5
    assert default_kv_fraction("cuda", 8 * GiB) == 0.5
    assert default_step_tokens("metal", 8 * GiB) == 2048 < default_step_tokens("metal", 32 * GiB)
    assert default_step_tokens("cuda", 8 * GiB) == 4096 and default_step_tokens("cpu", 256 * GiB) == 2048
    assert default_step_tokens("cuda", 40 * GiB) == 4096 < default_step_tokens("cuda", 80 * GiB) == 16384


def test_every_cache_is_inside_the_automatic_budget():
    asked = []

    def budget(fraction):
        asked.append(fraction)
        return 8 * GiB

    plan = plan_memory(EngineConfig(vision_cache_bytes=1 * GiB), "metal", 16 * GiB, budget, block_bytes=1 << 20,
                       takes_images=True)
    assert asked == [None]  # the device's default share
    assert plan.prefix_blocks == 2 * 1024 and plan.vision_cache_bytes == 1 * GiB
    assert plan.slot_budget == 5 * GiB and plan.total == 8 * GiB
    text_only = plan_memory(EngineConfig(prefix_cache=False), "cpu", 16 * GiB, budget, 1 << 20, takes_images=False)
    assert text_only.slot_budget == 8 * GiB and text_only.prefix_blocks == 0 and text_only.vision_cache_bytes == 0


def test_an_explicit_kv_budget_is_the_whole_budget_caches_included():
    """Issue 50: ``kv_budget_bytes`` bounds the running rows' slots, the prefix cache and the vision cache together,
    as the automatic budget does (they came on top of it: 1 GiB asked, 1.25 GiB and the vision cache held)."""
    def budget(fraction):
        raise AssertionError("an explicit budget asks the device nothing")

    explicit = plan_memory(EngineConfig(kv_budget_bytes=1 * GiB, vision_cache_bytes=GiB), "metal", 16 * GiB, budget,
                           1 << 20, takes_images=True)
    assert explicit.total <= 1 * GiB
    assert explicit.prefix_blocks == 256 and explicit.vision_cache_bytes == GiB // 4 and explicit.slot_budget == GiB // 2
    asked = plan_memory(EngineConfig(kv_budget_bytes=1 * GiB, prefix_cache_bytes=GiB), "cpu", 16 * GiB, budget,
                        1 << 20, takes_images=False)
    assert asked.total <= 1 * GiB and asked.slot_budget >= GiB // 4  # a prefix cache asked past it is cut to fit


def test_a_real_engine_keeps_its_caches_inside_an_explicit_budget(tiny_loaded):
    from mlxbatch.engine import EngineCore

    per_row = 256 * 1024  # bytes
    core = EngineCore(tiny_loaded, EngineConfig(warm_up=False, kv_budget_bytes=64 * per_row))
    try:
        block_bytes = core.worker.geometry.bytes_per_token * 16
        assert core.memory.total <= 64 * per_row
        assert core.scheduler.kv_budget_bytes + core.memory.prefix_blocks * block_bytes <= 64 * per_row
        assert core.memory.prefix_blocks > 0
    finally:
        core.shutdown()


class FakeMx:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.cache, self.wired = 100, 0

    def clear_cache(self) -> None:
        self.calls.append(("clear_cache", 0))

    def set_cache_limit(self, n: int) -> int:
        self.calls.append(("set_cache_limit", n))
        old, self.cache = self.cache, n
        return old

    def set_wired_limit(self, n: int) -> int:
        self.calls.append(("set_wired_limit", n))
        old, self.wired = self.wired, n
        return old

    limit, active = 500 * GiB, 3 * GiB

    def set_memory_limit(self, n: int) -> int:
        self.calls.append(("set_memory_limit", n))
        old, self.limit = self.limit, n
        return old

    def get_active_memory(self) -> int:
        return self.active


def test_metal_wires_weights_and_kv_and_restores_the_limits():
    fake = FakeMx()
    limits = MemoryLimits("metal", fake)
    limits.apply(working_set=11 * GiB, needed=6 * GiB)
    assert ("set_wired_limit", 6 * GiB) in fake.calls and fake.cache < 100 * GiB and fake.calls[0][0] == "clear_cache"
    limits.restore()
    assert (fake.cache, fake.wired) == (100, 0)
    limits = MemoryLimits("metal", fake)
    limits.apply(working_set=11 * GiB, needed=30 * GiB)
    assert fake.wired == 11 * GiB  # never more than the working set


def test_cuda_bounds_the_cache_but_wires_nothing_and_cpu_changes_nothing():
    fake = FakeMx()
    MemoryLimits("cuda", fake).apply(141 * GiB, 10 * GiB)
    assert not any(c[0] == "set_wired_limit" for c in fake.calls) and fake.cache != 100
    fake = FakeMx()
    MemoryLimits("cpu", fake).apply(24 * GiB, 1 * GiB)
    assert fake.calls == []


def test_a_step_is_bounded_to_what_mlx_holds_at_its_start_plus_the_step_bytes_and_the_limit_is_put_back():
    fake = FakeMx()
    limits = MemoryLimits("cuda", fake)
    limits.apply(141 * GiB, 10 * GiB, step_bytes=2 * GiB)
    with limits.step_bound():
        assert fake.limit == 3 * GiB + 2 * GiB  # active at the step's start + the bound
    assert fake.limit == 500 * GiB
    fake.active = 7 * GiB  # the next step starts from what MLX holds then (the KV grew)
    try:
        with limits.step_bound():
            assert fake.limit == 9 * GiB
            raise RuntimeError("a failed step")
    except RuntimeError:
        pass
    assert fake.limit == 500 * GiB  # put back when the step fails too
    for kind, step_bytes in (("cpu", 2 * GiB), ("cuda", 0)):  # the CPU and a bound of 0 change nothing
        fake = FakeMx()
        limits = MemoryLimits(kind, fake)
        limits.apply(24 * GiB, 1 * GiB, step_bytes=step_bytes)
        with limits.step_bound():
            pass
        assert not any(c[0] == "set_memory_limit" for c in fake.calls)


def test_step_bytes_by_device_and_by_config():
    def budget(fraction):
        return 8 * GiB

    assert default_step_bytes("cuda", 2048 * GiB) == 2 * GiB and default_step_bytes("cpu", 24 * GiB, 9 * GiB) == 0
    assert default_step_bytes("metal", 16 * GiB) == 1 * GiB and default_step_bytes("metal", 64 * GiB, 40 * GiB) == 2 * GiB
    # CUDA: half of what is free beside the weights and the KV budget, at least 2 GiB
    assert default_step_bytes("cuda", 64 * GiB, 40 * GiB) == 20 * GiB and default_step_bytes("cuda", 64 * GiB, GiB) == 2 * GiB
    assert plan_memory(EngineConfig(), "cuda", 1024 * GiB, budget, 1 << 20, False).step_bytes == 2 * GiB  # free unknown
    # an 80 GB GPU: 78 GiB free after the weights, 8 GiB of it the KV budget (slots and prefix cache): 35 GiB a step
    assert plan_memory(EngineConfig(), "cuda", 1024 * GiB, budget, 1 << 20, False, 78 * GiB).step_bytes == 35 * GiB
    assert plan_memory(EngineConfig(kv_budget_bytes=75 * GiB), "cuda", 1024 * GiB, budget, 1 << 20, False,
                       78 * GiB).step_bytes == 2 * GiB  # a budget that leaves little: the floor
    assert plan_memory(EngineConfig(step_memory_bytes=0), "cuda", 1024 * GiB, budget, 1 << 20, False).step_bytes == 0
    assert plan_memory(EngineConfig(step_memory_bytes=GiB // 2), "cpu", 8 * GiB, budget, 1 << 20,
                       False).step_bytes == GiB // 2


def test_every_step_of_a_real_engine_runs_inside_the_bound(tiny_loaded):
    """EngineCore.step executes the runner inside the step bound (a CUDA device's limits, MLX calls recorded), and
    outside a step the limit is what it was."""
    import mlx.core as mx

    from mlxbatch.engine import Engine
    from mlxbatch.types import SamplingParams

    engine = Engine(tiny_loaded, EngineConfig(warm_up=False, max_num_seqs=4))
    core = engine.core
    seen: list[tuple[int, int]] = []

    class Recording(FakeMx):
        set_at = 0  # MLX's active memory when the limit was last set (a launched step may free some after)

        def get_active_memory(self) -> int:
            return mx.get_active_memory()

        def set_memory_limit(self, n: int) -> int:
            self.set_at = mx.get_active_memory()
            return super().set_memory_limit(n)

    fake = Recording()
    core._limits = MemoryLimits("cuda", fake)
    core._limits.apply(24 * GiB, 1 * GiB, step_bytes=GiB)
    launch = core.runner.launch

    def recorded(out):
        seen.append((fake.limit, fake.set_at))
        return launch(out)

    core.runner.launch = recorded
    try:
        outs = engine.generate(["a b c", "d e f g", "h"], SamplingParams(temperature=0.0, max_tokens=4))
    finally:
        engine.close()
    assert len(outs) == 3 and len(seen) >= 4
    assert all(active <= limit <= active + GiB for limit, active in seen)
    assert fake.limit == 500 * GiB


def test_info_shows_the_machine_memory_and_the_working_set_on_a_mac(monkeypatch):
    """``mlxbatch info`` on a 16 GB Mac (device facts injected): the Metal working-set limit and the machine's memory
    are both shown and told apart; on this machine (CPU) both are the RAM."""
    import json

    from click.testing import CliRunner

    import mlxbatch.engine as engine_face
    from mlxbatch.cli import main
    from mlxbatch.engine import DeviceInfo, device_info

    real = CliRunner().invoke(main, ["info"])
    shown = json.loads(real.output)
    assert real.exit_code == 0 and shown["host_memory_gb"] == shown["total_memory_gb"] > 0
    here = device_info().batch_defaults  # a CPU's: 128 rows, 2048 tokens
    assert shown["batch_defaults"] == {"max_num_seqs": here.max_num_seqs, "max_num_batched_tokens":
                                       here.max_num_batched_tokens}
    mac = DeviceInfo("metal", "Apple M2", int(10.67 * 2**30), 6 * 2**30, "", 16 * 2**30)
    monkeypatch.setattr(engine_face, "device_info", lambda: mac)
    res = CliRunner().invoke(main, ["info"])
    shown = json.loads(res.output)
    assert res.exit_code == 0, res.output
    assert (shown["total_memory_gb"], shown["available_memory_gb"], shown["host_memory_gb"]) == (10.67, 6.0, 16.0)
    assert "working-set" in shown["total_memory_is"]
    assert shown["batch_defaults"] == {"max_num_seqs": 64, "max_num_batched_tokens": 2048}  # a 16 GB Mac's
