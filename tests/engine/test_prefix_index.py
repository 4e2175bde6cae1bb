"""Prefix reuse decisions on the scheduler's side, pinned exactly (pure Python, no model): which source a new
sequence's KV comes from, which blocks a finished prompt fills, what a failed step undoes, and the plan's
retention."""

from __future__ import annotations

from mlxbatch import SamplingParams
from mlxbatch.engine.decoding.detok import TextTracker
from mlxbatch.engine.request import Request, RequestStatus
from mlxbatch.engine.sched.blocks import block_hashes
from mlxbatch.engine.sched.prefix import BlockStore, CachedBlocks, PrefixIndex, RunningRow
from mlxbatch.engine.sched.prefix_books import InFlight
from mlxbatch.engine.sched.scheduler import Admission, Scheduler, SchedulerConfig

B = 4  # block size of these tests


def req(rid: str, tokens: list[int], cache_tokens: int | None = None, max_tokens: int = 4) -> Request:
    return Request(rid, rid, 0, list(tokens), SamplingParams(max_tokens=max_tokens), 0, frozenset({0}), 4096,
                   TextTracker(None, incremental=False), cache_tokens=cache_tokens)


def admit(ix: PrefixIndex, r: Request):
    """What the scheduler does when it admits ``r``: the match, then the computed tokens it starts from."""
    r.status = RequestStatus.PREFILLING
    source = ix.match(r)
    r.num_computed_tokens = source.num_tokens if source is not None else 0
    return source


def finish_prefill(ix: PrefixIndex, *rs: Request) -> tuple[BlockStore, ...]:
    stores = ix.plan_stores(list(rs))
    for r in rs:
        r.num_computed_tokens = r.num_prompt_tokens
        r.status = RequestStatus.DECODING
    ix.commit(stores, list(rs))
    ix.pool.check_integrity()
    return stores


def test_a_finished_prompt_fills_its_full_blocks_and_a_later_prompt_starts_from_them():
    ix = PrefixIndex(16, B)
    ix.begin_step()
    a = req("a", list(range(1, 11)))  # 10 tokens: 2 full blocks
    assert admit(ix, a) is None
    stores = finish_prefill(ix, a)
    assert [(s.request_id, s.first_block, len(s.block_ids)) for s in stores] == [("a", 0, 2)]
    a.status = RequestStatus.FINISHED
    ix.free("a")
    ix.begin_step()
    b = req("b", list(range(1, 9)) + [50, 51, 52])  # shares 8 tokens = 2 blocks
    src = admit(ix, b)
    assert src == CachedBlocks(stores[0].block_ids, 8)
    assert ix.plan_stores([]) == ()  # the matched blocks are released at the end of the step's scheduling
    ix.pool.check_integrity()
    assert ix.stats()["tokens_reused"] == 8


def test_a_running_row_beats_whole_blocks_but_not_in_the_step_it_was_admitted():
    ix = PrefixIndex(16, B)
    ix.begin_step()
    a = req("a", list(range(1, 20)))
    admit(ix, a)
    b = req("b", list(range(1, 15)) + [99])
    assert admit(ix, b) is None  # a was admitted this very step: its row holds nothing yet
    ix.plan_stores([])
    a.num_computed_tokens = 19  # a's prefill ran (still running: it decodes now)
    a.status = RequestStatus.DECODING
    ix.begin_step()
    c = req("c", list(range(1, 15)) + [77])
    assert admit(ix, c) == RunningRow("a", 14)  # to the token, beyond the cache's whole blocks
    assert ix.stats()["tokens_reused_live"] == 14


def _running(ix: PrefixIndex, rows: list[Request]) -> None:
    """``rows`` admitted in an earlier step, prefilled and decoding (sources a later row can copy from)."""
    ix.begin_step()
    for r in rows:
        admit(ix, r)
    ix.plan_stores([])
    for r in rows:
        r.num_computed_tokens, r.status = r.num_prompt_tokens, RequestStatus.DECODING
    ix.begin_step()


def test_the_running_row_search_compares_whole_prefixes_only_with_rows_that_can_win(monkeypatch):
    """A job's rows share their instruction and differ after it: the search rejects a running row by the one token it
    must share to beat what is found so far, before comparing prefixes (each a slice of ~1k ids) with it."""
    import mlxbatch.engine.sched.prefix as prefix_mod

    calls = []
    full = prefix_mod.common_prefix_len
    monkeypatch.setattr(prefix_mod, "common_prefix_len", lambda a, b: calls.append(b) or full(a, b))
    ix = PrefixIndex(64, B)
    others = [req(f"r{i}", [1, 2, 3, 100 + i, 5, 6, 7, 8, 9]) for i in range(10)]  # 3 tokens shared: under a block
    a = req("a", list(range(1, 20)))
    _running(ix, [*others, a])
    calls.clear()
    assert admit(ix, req("c", list(range(1, 15)) + [77])) == RunningRow("a", 14)
    # only "a" was compared in full (besides the block hashes' comparison with the last prompt hashed: "a" too)
    assert calls[-1] == a.prompt_token_ids
    assert not [ids for ids in calls if any(ids == o.prompt_token_ids for o in others)]


def test_the_running_row_search_finds_what_comparing_every_row_finds():
    """Pinned against the plain search (every running row compared in full) on random prompts over few symbols."""
    import random

    from mlxbatch.engine.sched.planner import common_prefix_len

    rng = random.Random(7)
    for trial in range(200):
        ix = PrefixIndex(256, B)
        rows = [req(f"s{i}", [1] + [rng.randrange(2) for _ in range(rng.randrange(1, 14))]) for i in range(6)]
        _running(ix, rows)
        for r in rows:
            r.num_computed_tokens = rng.randrange(1, r.num_prompt_tokens + 1)
        tokens = [1] + [rng.randrange(2) for _ in range(rng.randrange(1, 16))]
        at_least = rng.choice([0, 0, 4, 8])
        limit = len(tokens) - 1
        want = None
        for src in rows:
            n = min(common_prefix_len(tokens, src.prompt_token_ids), src.num_computed_tokens, limit)
            if n > (want.num_tokens if want else at_least) and n >= B:
                want = RunningRow(src.request_id, n)
        new = req(f"t{trial}", tokens)
        assert ix._running_row(new, tokens, at_least) == want, (trial, tokens, at_least)


def test_a_failed_step_registers_nothing_and_frees_its_blocks():
    ix = PrefixIndex(8, B)
    ix.begin_step()
    a = req("a", list(range(1, 13)))
    admit(ix, a)
    stores = ix.plan_stores([a])
    assert sum(len(s.block_ids) for s in stores) == 3
    ix.abort_step(stores)
    ix.pool.check_integrity()
    assert ix.pool.stats.blocks_cached == 0 and ix.pool.num_available == 8


def test_two_prompts_finishing_in_one_step_store_a_shared_block_once():
    ix = PrefixIndex(16, B)
    ix.begin_step()
    a, b = req("a", list(range(1, 10))), req("b", list(range(1, 5)) + [60, 61, 62, 63, 64])
    admit(ix, a)
    admit(ix, b)
    stores = finish_prefill(ix, a, b)
    assert [(s.request_id, s.first_block, len(s.block_ids)) for s in stores] == [("a", 0, 2), ("b", 1, 1)]
    assert ix.pool.stats.blocks_cached == 3


def test_the_plan_drops_a_prefix_past_what_later_rows_share():
    ix = PrefixIndex(16, B)
    ix.begin_step()
    a = req("a", list(range(1, 14)), cache_tokens=4)  # later rows share its first block only
    admit(ix, a)
    finish_prefill(ix, a)
    assert ix.pool.stats.blocks_cached == 1 and ix.plan_evictions == 0
    ix.begin_step()
    b = req("b", list(range(1, 14)), cache_tokens=None)  # no plan: offers every block...
    admit(ix, b)
    finish_prefill(ix, b)
    assert ix.pool.stats.blocks_cached == 3
    ix.begin_step()
    c = req("c", list(range(1, 14)) + [5], cache_tokens=4)  # ...and a planned row admitted later drops them again
    admit(ix, c)
    ix.plan_stores([])
    ix.commit((), [])
    assert ix.pool.stats.blocks_cached == 1 and ix.plan_evictions == 2


def test_a_sequence_waits_while_its_prefix_is_being_computed():
    ix = PrefixIndex(16, B)
    ix.begin_step()
    a = req("a", list(range(1, 30)))
    admit(ix, a)
    ix.plan_stores([])
    assert ix.in_progress(req("b", list(range(1, 20)) + [9]))
    assert not ix.in_progress(req("c", [5] + list(range(1, 20))))
    finish_prefill(ix, a)
    assert not ix.in_progress(req("b", list(range(1, 20)) + [9]))  # its blocks are cached now


def test_scheduler_output_lists_admissions_with_sources_and_the_stores():
    ix = PrefixIndex(32, B)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk_size=64),
                  lambda lengths: sum(lengths), ix)
    s.add(req("a", list(range(1, 14))))
    out = s.schedule()
    assert out.admissions == (Admission(out.prefills[0].request, None),)
    assert [(st.request_id, len(st.block_ids)) for st in out.stores] == [("a", 3)]  # 13 tokens: 3 full blocks
    for c in out.prefills:
        c.request.append(7, None)
    s.finish_step(out)
    s.add(req("b", list(range(1, 14)) + [40, 41]))
    out = s.schedule()
    (adm,) = out.admissions
    assert adm.request.request_id == "b" and adm.source == RunningRow("a", 13)  # more than the 3 cached blocks
    assert [(c.request.request_id, c.start) for c in out.prefills] == [("b", 13)]


def test_a_shared_prefix_ending_mid_block_is_reused_to_the_token_then_dropped():
    ix = PrefixIndex(16, B)
    ix.begin_step()
    shared = [5, 6, 7, 8, 9, 10]  # a block and a half
    a = req("a", shared + [1, 2, 3], cache_tokens=6)  # the plan: the next row shares 6 tokens
    admit(ix, a)
    stores = finish_prefill(ix, a)
    assert [(s.first_block, len(s.block_ids)) for s in stores] == [(0, 1), (1, 1)]  # a whole block, then a partial
    ix.begin_step()
    b = req("b", shared + [40, 41], cache_tokens=0)  # the group's last row
    src = admit(ix, b)
    assert isinstance(src, CachedBlocks) and src.num_tokens == 6 and len(src.block_ids) == 2
    finish_prefill(ix, b)
    assert ix.pool.stats.blocks_cached == 0 and ix.plan_evictions == 2  # both dead once their last user is in


def test_a_row_identical_to_a_finished_one_reuses_all_but_its_last_token():
    """Issue #15: a prompt equal to an earlier one (the plan's retention: all of it) is cached to its end; the later
    row reuses all but its last token (whose logits it needs) from the partial block, or from the whole block when
    the prompt ends a block. Before: a 15-token partial never matched a 14-token lookup (label: 1450 vs 652)."""
    for n in (7, 8):  # ends mid-block, ends a block
        ix = PrefixIndex(16, B)
        ix.begin_step()
        a = req("a", list(range(1, n + 1)), cache_tokens=n)  # the next row shares all n tokens
        admit(ix, a)
        finish_prefill(ix, a)
        a.status = RequestStatus.FINISHED
        ix.free("a")
        ix.begin_step()
        b = req("b", list(range(1, n + 1)), cache_tokens=0)
        src = admit(ix, b)
        assert isinstance(src, CachedBlocks) and src.num_tokens == n - 1, (n, src)
        assert len(src.block_ids) == 2
        finish_prefill(ix, b)
        assert ix.pool.stats.blocks_cached == 0, n  # dead once their last user is in (the prompt's last block too)


def test_a_row_identical_to_one_being_prefilled_forks_it_and_computes_nothing():
    """Duplicate rows admitted while their twin prefills (the same step, or its prefill still running) fork its
    KV and last logits as another sample would: no prefill tokens, no extra pass; scoring rows never fork."""
    ix = PrefixIndex(64, B)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk_size=64),
                  lambda lengths: 0, ix)
    prompt = list(range(1, 12))
    a, b, c = req("a", prompt, cache_tokens=11), req("b", prompt, cache_tokens=11), req("c", prompt, cache_tokens=0)
    scored = req("d", prompt + [40])
    scored.score_from = len(prompt)
    for r in (a, b, c, scored):
        s.add(r)
    out = s.schedule()
    assert [adm.request.request_id for adm in out.admissions] == ["a"]  # d waits for a's blocks
    assert [(p.request_id, ch.request_id) for p, ch in out.forks] == [("a", "b"), ("a", "c")]
    assert out.num_tokens == 11 and b.num_cached_tokens == c.num_cached_tokens == 11
    assert a.cache_tokens == 11  # the parent keeps what its twins' later rows share
    s.finish_step(out)
    assert b.status is c.status is RequestStatus.DECODING and b.num_computed_tokens == 11
    assert ix.stats()["tokens_reused"] == 22
    out = s.schedule()  # the scoring row reuses the cache instead
    assert [adm.request.request_id for adm in out.admissions] == ["d"] and not out.forks


def test_rows_that_waited_for_a_prompt_get_its_partial_block_where_they_share_it():
    """Issue #15 (eval: 764 -> 647 tokens): rows waiting for a planned prompt's blocks share it to different depths
    past its last whole block; when its prefill ends it also caches the partial block at each depth they share, so
    once admitted they reuse it to the token though the prompt has finished (its retention point serves only the
    row after it in the plan)."""
    ix = PrefixIndex(64, B)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk_size=64),
                  lambda lengths: 0, ix)
    head = list(range(1, 9))  # 2 whole blocks
    a = req("a", head + [20, 21, 22, 23], cache_tokens=11)
    b = req("b", head + [20, 21, 22, 50], cache_tokens=9)  # shares 11 with a
    c = req("c", head + [20, 60, 61], cache_tokens=0)  # shares 9 with a and b
    for r in (a, b, c):
        s.add(r)
    out = s.schedule()
    assert [adm.request.request_id for adm in out.admissions] == ["a"]  # b and c wait for a's whole blocks
    # 2 whole blocks, then partial blocks at 11 tokens (its retention: b) and at 9 (where c shares it)
    assert [(st.first_block, len(st.block_ids)) for st in out.stores] == [(0, 2), (2, 1), (2, 1)]
    a.status = RequestStatus.FINISHED  # a scoring row, or one that stopped at once: it is gone by the next step
    s.finish_step(out)
    out = s.schedule()
    got = {adm.request.request_id: adm.source.num_tokens for adm in out.admissions}
    assert got == {"b": 11, "c": 9}, got  # before: {"b": 11, "c": 8} (whole blocks only for c)


def gone(ix: PrefixIndex, *rs: Request) -> None:
    """``rs`` finished in their prefill step (one-token answers): freed before the next step."""
    for r in rs:
        r.status = RequestStatus.FINISHED
        ix.free(r.request_id)


def test_a_partial_block_outlives_a_row_whose_next_row_shares_more():
    """Issue #15 (demo, one-token answers: 3044 tokens computed against 2633 predicted): a row that matched the
    partial block at 6 tokens and shares 7 with the row after it dropped that partial, so a row sharing exactly 6
    with them, admitted with the group's last row, found the whole block only once they had finished (a running
    row served it to the token when answers were sentences)."""
    ix = PrefixIndex(16, B)
    shared = [5, 6, 7, 8, 9, 10]  # a block and a half
    a = req("a", shared + [1, 2, 3], cache_tokens=6)
    ix.begin_step()
    admit(ix, a)
    finish_prefill(ix, a)
    gone(ix, a)
    b = req("b", shared + [20, 21, 1], cache_tokens=7)  # matches the partial at 6; its next row shares 7
    ix.begin_step()
    assert admit(ix, b).num_tokens == 6
    finish_prefill(ix, b)
    gone(ix, b)
    c = req("c", shared + [20, 22, 2], cache_tokens=6)  # reuses 7 (b's retention point)
    d = req("d", shared + [30, 31], cache_tokens=0)  # admitted with c, shares exactly 6 with all of them
    ix.begin_step()
    assert admit(ix, c).num_tokens == 7
    src = admit(ix, d)
    assert isinstance(src, CachedBlocks) and src.num_tokens == 6, src  # before: 4 (the whole block only)


def test_a_forked_prompt_keeps_its_twins_retention_point():
    """Issue #15: a twin forks its parent's KV; the row after the twin shares less with it than the twin with its
    parent. The parent caches a partial block at the twin's retention point too, so that row reuses it to the token
    after parent and twin finished in their prefill step (before: the parent's retention only)."""
    ix = PrefixIndex(64, B)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk_size=64),
                  lambda lengths: 0, ix)
    head = [1, 2, 3, 4, 5, 6]
    a, b = req("a", head + [7, 8, 9], cache_tokens=9), req("b", head + [7, 8, 9], cache_tokens=6)
    for r in (a, b):
        s.add(r)
    out = s.schedule()
    assert [(p.request_id, ch.request_id) for p, ch in out.forks] == [("a", "b")]
    # 2 whole blocks, partial blocks at 6 tokens (b's retention: before, none) and at 9 (a's)
    assert [(st.first_block, len(st.block_ids)) for st in out.stores] == [(0, 2), (1, 1), (2, 1)]
    a.status = b.status = RequestStatus.FINISHED
    s.finish_step(out)
    c = req("c", head + [40, 41], cache_tokens=0)
    s.add(c)
    out = s.schedule()
    assert [adm.source.num_tokens for adm in out.admissions] == [6]


def test_a_row_that_waited_keeps_its_blocks_when_rows_behind_it_are_admitted_first():
    """Issue #15: rows behind a waiting row in the plan's order are admitted before it; the last of a group shares
    nothing with its next row and its admission dropped the group's blocks, the waiting row's too (16 demo rows:
    294 tokens predicted, 326 computed)."""
    ix = PrefixIndex(64, B)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk_size=64),
                  lambda lengths: 0, ix)
    a = req("a", list(range(1, 10)), cache_tokens=4)
    s.add(a)
    out = s.schedule()
    a.status = RequestStatus.FINISHED
    s.finish_step(out)
    b = req("b", list(range(1, 9)) + [50, 51], cache_tokens=8)  # computes a second block
    c = req("c", list(range(1, 9)) + [60, 61], cache_tokens=4)  # waits for it
    d = req("d", list(range(1, 5)) + [70, 71, 72], cache_tokens=0)  # goes first, and drops block 1 (its own)
    for r in (b, c, d):
        s.add(r)
    out = s.schedule()
    assert [adm.request.request_id for adm in out.admissions] == ["b", "d"]
    b.status = d.status = RequestStatus.FINISHED
    s.finish_step(out)
    out = s.schedule()
    assert [(adm.request.request_id, adm.source.num_tokens) for adm in out.admissions] == [("c", 8)]


def test_partial_books_keep_what_the_pool_holds_and_stay_bounded():
    """``_cached`` hashes only the partial lengths stored after a full block (it hashed every length from 15 down);
    the books of stored partials forget evicted ones once they outgrow the pool, and a partial found before the
    pruning is found after it."""
    ix = PrefixIndex(8, B)  # a small pool: the partials of most rows below are evicted by later stores
    for i in range(1100):  # each row its own first block, then a partial block of 2 tokens kept (cache_tokens 6)
        a = req(f"a{i}", [100 + i, 1, 2, 3, 5, 6, i % 7, 4], cache_tokens=6)
        ix.begin_step()
        admit(ix, a)
        finish_prefill(ix, a)
        gone(ix, a)
    noted = sum(len(hs) for by_len in ix.partials.lengths.values() for hs in by_len.values())
    assert noted <= 1024 + 1 and noted == ix.partials.noted
    held = {h for by_len in ix.partials.lengths.values() for hs in by_len.values() for h in hs if ix.pool.has(h)}
    assert held  # the most recent partials are still cached and still noted
    last = req("z", [100 + 1099, 1, 2, 3, 5, 6, 9, 9, 9], cache_tokens=0)
    ix.begin_step()
    src = admit(ix, last)
    assert isinstance(src, CachedBlocks) and src.num_tokens == 6, src  # the last row's partial, to the token


def test_prompts_sharing_blocks_with_the_last_hashed_get_the_chain_hashing_all_of_them_gives():
    """Hashes taken from the last prompt hashed (the blocks both share) leave every sequence's chain as hashing its
    own tokens gives, whatever it shares: a cached block is matched exactly when the prompts agree up to its end."""
    ix = PrefixIndex(64, B)
    shared = list(range(1, 14))  # 3 whole blocks and a token
    prompts = [shared + [20, 21, 22, 23, 24], shared + [30, 31, 32], shared[:6] + [40] * 9, list(range(50, 62)),
               shared + [20, 21, 22, 23, 25, 26]]
    for i, tokens in enumerate(prompts):
        ix.begin_step()
        r = req(f"r{i}", tokens)
        admit(ix, r)
        assert ix.chains.chain(r) == block_hashes(tokens, B)


def test_a_sequence_with_generated_tokens_extends_its_own_chain_to_what_hashing_all_its_tokens_gives():
    """A sequence restarted after it generated (a preemption) is matched on its prompt and its generated tokens: its
    chain, hashed for its prompt first, grows from its own blocks to the chain all its tokens hash to, though another
    prompt sharing its first block was hashed in between (the blocks a chain takes from the last one hashed)."""
    ix = PrefixIndex(64, B)
    a = req("a", list(range(1, 11)), max_tokens=16)  # 10 tokens: 2 full blocks
    assert ix.chains.chain(a) == block_hashes(a.prompt_token_ids, B)
    b = req("b", list(range(1, 5)) + [7] * 12)  # a's first block, then 3 of its own
    assert ix.chains.chain(b) == block_hashes(b.prompt_token_ids, B)
    for t in range(11, 18):
        a.append(t, None)
    assert ix.chains.chain(a) == block_hashes(list(range(1, 18)), B)  # 17 tokens: 4 full blocks


def test_the_blocks_spared_for_sequences_that_waited_are_those_of_the_ones_still_waiting():
    """``InFlight.spared`` (what the plan's eviction leaves for sequences that waited and are not admitted yet), kept
    as sequences wait, wait again, are admitted or freed, is the union of the blocks of those still waiting: a block
    two of them hold stays until both are gone."""
    f = InFlight()
    a, b, c = req("a", range(1, 10)), req("b", range(1, 10)), req("c", range(1, 10))
    f.wait(a, 1, [1, 2, 3])
    f.wait(b, 2, [1, 2, 4])
    assert set(f.spared()) == {1, 2, 3, 4}
    f.wait(a, 1, [1, 2, 3])  # waits again, for the same blocks
    f.wait(b, 5, [1, 5])  # ... or for others
    assert set(f.spared()) == {1, 2, 3, 5}
    f.start("a", [9])  # admitted: it waits no more
    assert set(f.spared()) == {1, 5}
    f.wait(c, 1, [1])
    f.forget("b")
    assert set(f.spared()) == {1}
    f.forget("c")
    assert not f.spared()


def test_a_running_row_must_beat_the_cache_by_the_live_margin():
    """With ``live_margin`` (the engine's reuse step) a running row is copied from only when it gives that many
    tokens more than the cache: 2 more than the cached blocks is a copy at margin 1, the blocks at margin 4."""
    for margin, want in ((1, RunningRow("a", 18)), (3, None), (4, None)):
        ix = PrefixIndex(16, B, live_margin=margin)
        ix.begin_step()
        a = req("a", list(range(1, 20)))  # 19 tokens: 4 full blocks cached when its prefill ends
        admit(ix, a)
        finish_prefill(ix, a)
        ix.begin_step()
        c = req("c", list(range(1, 19)) + [77])  # shares 18 with a: 16 in the cache's blocks
        src = admit(ix, c)
        if want is None:
            assert isinstance(src, CachedBlocks) and src.num_tokens == 16, (margin, src)
        else:
            assert src == want, (margin, src)
    ix = PrefixIndex(16, B, live_margin=2)
    ix.begin_step()
    admit(ix, a := req("a", list(range(1, 20))))
    finish_prefill(ix, a)
    ix.begin_step()
    assert admit(ix, req("c", list(range(1, 19)) + [77])) == RunningRow("a", 18)  # 2 more: enough at margin 2
