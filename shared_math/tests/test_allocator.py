"""Host page allocator: tables, demotion, prefix sharing scoped by namespace, exhaustion, invariants."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared_math.allocator import SCRATCH_PAGE, UNKNOWN_TOKEN, PageAllocator, PoolExhausted
from shared_math.spec import OscarConfig
from shared_math.tiers import tier_split

CFG = OscarConfig(head_dim=64, sink=32, recent=64, page_size=16)


def _alloc(bf16=64, int2=64):
    return PageAllocator(CFG, num_bf16_pages=bf16, num_int2_pages=int2)


def _step(a, sid, token):
    d = a.extend(sid, token)
    if d is not None:
        a.demoted(d)
    return d


@pytest.mark.parametrize("length", [1, 15, 16, 17, 32, 33, 96, 111, 112, 113, 200])
def test_admit_tables_match_the_tier_split(length):
    a = _alloc()
    plan = a.admit(range(length))
    t = a.tables([plan.seq_id], history_slots=16)
    split = tier_split(length, CFG)
    assert (t["sink_tokens"][0], t["history_tokens"][0], t["recent_tokens"][0]) == (
        split.sink_tokens, split.history_tokens, split.recent_tokens)
    assert np.count_nonzero(t["history_page_table"]) == split.history_pages
    assert np.count_nonzero(t["bf16_page_table"]) == split.bf16_pages
    assert t["bf16_page_table"].dtype == np.int32
    a.check_invariants()


def test_decoding_demotes_the_oldest_recent_page_and_matches_prefill():
    a = _alloc()
    sid = a.admit(range(40)).seq_id
    demotions = []
    for token in range(40, 300):
        before = a.tables([sid], 32)
        d = a.extend(sid, token)
        if d is not None:
            during = a.tables([sid], 32)
            assert during["bf16_page_table"][0, CFG.sink // 16] == d.src_bf16_page  # still the oldest recent page
            assert during["history_tokens"][0] == before["history_tokens"][0]
            a.demoted(d)
            demotions.append(token)
        a.check_invariants()
        t = a.tables([sid], 32)
        split = tier_split(token + 1, CFG)
        assert (t["history_tokens"][0], t["recent_tokens"][0]) == (split.history_tokens, split.recent_tokens)
    assert demotions[0] == CFG.sink + CFG.recent + CFG.page_size - 1  # window reached W + page
    assert all(b - a_ == 16 for a_, b in zip(demotions, demotions[1:]))


def test_prefix_sharing_reuses_sink_and_history_pages_only_in_the_namespace():
    a = _alloc()
    prompt = list(range(1000, 1200))
    first = a.admit(prompt, namespace="alice")
    assert first.reused_tokens == 0
    second = a.admit(prompt + [7, 8, 9], namespace="alice")
    split = tier_split(len(prompt), CFG)
    assert second.reused_tokens == split.recent_start  # all sink + history pages of the first prompt
    s1, s2 = a.sequences[first.seq_id], a.sequences[second.seq_id]
    assert s2.sink_pages == s1.sink_pages and s2.history_pages[: len(s1.history_pages)] == s1.history_pages
    assert not set(s1.recent_pages) & set(s2.recent_pages)  # recent pages stay private
    other = a.admit(prompt, namespace="bob")
    assert other.reused_tokens == 0
    s3 = a.sequences[other.seq_id]
    assert not set(s3.sink_pages) & set(s1.sink_pages) and not set(s3.history_pages) & set(s1.history_pages)
    different = a.admit([5] + prompt[1:], namespace="alice")
    assert different.reused_tokens == 0  # the first token differs: no page matches
    a.check_invariants()


def test_shorter_prompt_reuses_only_its_own_history_range_and_cached_pages_survive_finish():
    a = _alloc()
    long = list(range(300))
    sid = a.admit(long).seq_id
    a.finish(sid)
    a.check_invariants()
    short = a.admit(long[:120])
    assert short.reused_tokens == tier_split(120, CFG).recent_start  # pages were cached, not lost
    a.check_invariants()


def test_pool_exhaustion_is_an_error_and_never_evicts_live_pages():
    a = _alloc(bf16=8, int2=4)  # 7 usable BF16 pages
    sid = a.admit(range(100)).seq_id  # 2 sink + 5 recent pages: the whole BF16 pool
    live = set(a.sequences[sid].sink_pages + a.sequences[sid].recent_pages)
    with pytest.raises(PoolExhausted, match="bf16 page pool exhausted"):
        a.admit(range(500, 600))
    assert live == set(a.sequences[sid].sink_pages + a.sequences[sid].recent_pages)
    a.check_invariants()
    with pytest.raises(PoolExhausted):
        for token in range(100, 400):
            _step(a, sid, token)
    a.check_invariants()  # a failed extend leaves no half-allocated state


def test_bad_calls():
    a = _alloc()
    with pytest.raises(ValueError, match="empty prompt"):
        a.admit([])
    with pytest.raises(KeyError, match="seq_id=99"):
        a.extend(99, 1)
    with pytest.raises(ValueError, match="at least 2 pages"):
        PageAllocator(CFG, num_bf16_pages=1, num_int2_pages=4)
    sid = a.admit(range(300)).seq_id
    with pytest.raises(ValueError, match="history_slots=1"):
        a.tables([sid], history_slots=1)
    assert a.tables([sid], 32)["history_page_table"][0, -1] == SCRATCH_PAGE


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "extend", "finish"]), st.integers(0, 10**6)), min_size=1, max_size=60))
def test_random_admit_extend_finish_keeps_invariants(ops):
    a = _alloc(bf16=40, int2=40)
    rng = np.random.default_rng(0)
    for op, x in ops:
        live = sorted(a.sequences)
        try:
            if op == "admit" or not live:
                base = [x % 3] * (x % 5)  # shared-looking prefixes
                a.admit(base + list(rng.integers(0, 4, size=1 + x % 150)), namespace=("t", x % 2))
            elif op == "extend":
                sid = live[x % len(live)]
                for _ in range(1 + x % 40):
                    _step(a, sid, int(rng.integers(0, 4)))
            else:
                a.finish(live[x % len(live)])
        except PoolExhausted:
            pass
        a.check_invariants()
    for sid in list(a.sequences):
        a.finish(sid)
    a.check_invariants()
    assert all(a.bf16.refs == 0) and all(a.int2.refs == 0)


def test_prefix_keys_chain_page_by_page_and_hash_each_page_once(monkeypatch):
    """A page's key names (namespace, every token up to its end): equal for equal prefixes, apart
    for another namespace or any earlier token; and it is computed once per page from that page's
    tokens, so registering a long prompt chunk by chunk hashes each token once (not every prefix
    again at every chunk: O(length²) host work per chunk at 100K tokens)."""
    from shared_math import allocator as allocator_module

    config = OscarConfig(head_dim=64, sink=16, recent=32, page_size=16)
    alloc = PageAllocator(config, num_bf16_pages=64, num_int2_pages=64)
    hashed = []
    chained = allocator_module._chained_key
    monkeypatch.setattr(allocator_module, "_chained_key", lambda prev, tokens: hashed.append(len(tokens))
                        or chained(prev, tokens))
    tokens = list(range(1000, 1000 + 16 * 12))
    a = alloc.sequences[alloc.admit(tokens, namespace="a", share_prefix=False).seq_id]
    for _ in range(3):  # as a runtime publishing after every chunk does
        keys = [alloc._page_end_key(a, end) for end in range(16, len(tokens) + 1, 16)]
    assert hashed == [16] * 12  # each page once, from its own 16 tokens
    assert len(set(keys)) == 12
    fork = tokens[:16 * 5] + [7] + tokens[16 * 5 + 1:]  # differs from token 80 on
    b = alloc.sequences[alloc.admit(fork, namespace="a", share_prefix=False).seq_id]
    c = alloc.sequences[alloc.admit(tokens, namespace="c", share_prefix=False).seq_id]
    for end in range(16, len(tokens) + 1, 16):
        assert (alloc._page_end_key(b, end) == alloc._page_end_key(a, end)) == (end <= 16 * 5), end
        assert alloc._page_end_key(c, end) != alloc._page_end_key(a, end), end
    with pytest.raises(ValueError, match="page end 24 must be a multiple of page_size=16"):
        alloc._page_end_key(a, 24)


def test_tokens_of_unknown_value_are_filled_in_and_never_hashed():
    """extend(sid, None) then set_token gives the same pages, keys and prefix hits as extend with
    the value; a page holding an unknown token is never keyed."""
    known, later = _alloc(), _alloc()
    tokens = list(range(500, 700))
    a_sid, b_sid = known.admit(tokens[:5], namespace="t").seq_id, later.admit(tokens[:5], namespace="t").seq_id
    for position in range(5, len(tokens)):
        _step(known, a_sid, tokens[position])
        d = later.extend(b_sid, None)
        assert later.sequences[b_sid].tokens[position] == UNKNOWN_TOKEN
        later.set_token(b_sid, position, tokens[position])
        if d is not None:
            later.demoted(d)
        later.check_invariants()
    for a in (known, later):
        assert a.sequences[0].tokens == tokens
    assert known.bf16.registry.keys() == later.bf16.registry.keys()  # the sink pages, keyed once known
    assert known.int2.registry.keys() == later.int2.registry.keys()
    for a in (known, later):  # a later prompt of the same tenant reuses them
        assert a.admit(tokens + [1], namespace="t").reused_tokens == tier_split(len(tokens), CFG).recent_start

    a = _alloc()
    sid = a.admit(tokens[:20], namespace="t").seq_id
    for _ in range(12):  # position 31 completes the second sink page while unknown
        a.extend(sid, None)
    assert len(a.bf16.registry) == 1  # only the first sink page: the second holds unknown tokens
    with pytest.raises(RuntimeError, match="not known yet"):
        a._page_end_key(a.sequences[sid], 32)
    with pytest.raises(ValueError, match="position 3 of sequence"):
        a.set_token(sid, 3, 9)  # a known token
    with pytest.raises(ValueError, match="negative"):
        a.set_token(sid, 25, -4)
    for position in range(20, 32):
        a.set_token(sid, position, tokens[position])
    assert len(a.bf16.registry) == 2  # the value that completed the second sink page registered it
