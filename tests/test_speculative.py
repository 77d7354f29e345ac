"""Speculative decoding: the proposers' matches, lossless verification and rollback.

Greedy float32 outputs are the same with speculation on and off (both proposers; with prefix
caching, chunked prefill, preemption; through a 1P1D deployment); sampled outputs keep the target
distribution (chi-square against transformers' probabilities on a tiny model), and a seeded
request's tokens do not depend on speculation at all; rejected drafts never reach the prefix cache.
"""

from __future__ import annotations

import inspect
import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import FP32_1P1D, SUFFIX
from transformers import LlamaConfig, LlamaForCausalLM

from tandem import SamplingParams
from tandem.config import SpeculativeConfig
from tandem.engine.request import Request, RequestStatus
from tandem.engine.sampler import sample
from tandem.speculative.matching import SEP, frequent_continuation, suffix_matches
from tandem.speculative.ngram import NgramProposer
from tandem.speculative.policy import SpecPolicy, StepCost
from tandem.speculative.suffix import SuffixProposer

NGRAM = {"method": "ngram", "num_speculative_tokens": 6, "adaptive": False}
# Chi-square critical values at p = 1e-4, by degrees of freedom: the tests are deterministic (fixed
# seeds), and a biased sampler lands far above them at these sample sizes.
CHI2_CRITICAL = {4: 23.51, 15: 42.58}


def copy_prompts() -> list[str]:
    """Prompts whose answers copy from them: code and JSON that ship with Python."""
    code = textwrap.dedent(inspect.getsource(textwrap.TextWrapper._split))[:900]
    data = json.dumps({"name": "tandem", "version": "0.1", "features": ["paged kv", "prefix cache", "speculation"],
                       "limits": {"max_tokens": 128, "timeout": 30}}, indent=1)
    return [f"{code}\n# The same function, repeated exactly:\n{code[:60]}",
            f"Input JSON:\n{data}\nThe same JSON with its keys in the same order:\n{data[:20]}",
            "one two three four five one two three four five one two three"]


def _req(tokens: list[int], rid: str = "r", tenant: str | None = None, out: list[int] | None = None) -> Request:
    r = Request(rid, tokens, SamplingParams(), tenant=tenant)
    for t in out or []:
        r.append_output_token(t)
    return r


# -- matching and proposers ---------------------------------------------------------------------------------------
def _brute_matches(history: list[int], pattern: list[int], max_len: int) -> tuple[int, set[int]]:
    best, ends = 0, set()
    for m in range(1, min(max_len, len(pattern)) + 1):
        found = {e for e in range(m, len(history)) if history[e - m:e] == pattern[-m:] and history[e] != SEP}
        if not found:
            break
        best, ends = m, found
    return best, ends


def test_suffix_matches_equal_a_brute_force_search() -> None:
    rng = np.random.default_rng(0)
    for trial in range(200):
        history = rng.integers(0, 3, rng.integers(2, 60)).tolist()
        if trial % 3 == 0:  # a shared history: sequences separated by SEP
            history = [t if rng.random() > 0.1 else SEP for t in history]
        pattern = rng.integers(0, 3, rng.integers(1, 8)).tolist() if trial % 2 else history[-8:]
        if SEP in pattern:
            continue
        m, ends = suffix_matches(np.asarray(history, dtype=np.int32), np.asarray(pattern, dtype=np.int32), 6)
        expected_m, expected_ends = _brute_matches(history, pattern, 6)
        assert (m, set(ends.tolist())) == (expected_m, expected_ends), (history, pattern)


def test_frequent_continuation_follows_the_majority_and_stops_below_min_prob() -> None:
    # "1 2" is followed by 3 twice and by 4 once; "1 2 3" always by 5 then the end.
    h = np.asarray([1, 2, 3, 5, SEP, 1, 2, 4, SEP, 1, 2, 3, 5, 6, SEP], dtype=np.int32)
    m, ends = suffix_matches(h, np.asarray([9, 1, 2], dtype=np.int32), 8)
    assert m == 2 and sorted(ends.tolist()) == [2, 7, 11]
    tokens, expected = frequent_continuation(h, ends, 8, 0.1)
    assert tokens == [3, 5] and expected == pytest.approx(2 / 3 + 2 / 3)
    # The walk stops where the path's probability falls below min_prob.
    assert frequent_continuation(h, ends, 8, 0.7)[0] == []
    assert frequent_continuation(h, ends, 1, 0.1)[0] == [3]


def test_ngram_proposes_what_followed_the_most_recent_match() -> None:
    p = NgramProposer(max_n=3, min_n=2)
    r = _req([7, 1, 2, 3, 8, 1, 2, 4, 9, 1, 2])
    assert p.propose([r], [3])[0].tokens == [4, 9, 1]
    assert p.propose([r], [3])[0].match_len == 2
    # A growing request is synced incrementally; below min_n nothing is proposed.
    r.append_output_token(5)
    assert p.propose([r], [3])[0].tokens == []
    p.finish(r, completed=False)
    assert not p._history


def test_suffix_learns_from_finished_outputs_of_the_same_tenant_only() -> None:
    p = SuffixProposer(max_depth=16, max_cached_requests=4, max_spec_factor=4.0, min_token_prob=0.1)
    done = _req([1], "a", tenant="alice", out=[40, 41, 42, 43, 44, 45])
    done.status = RequestStatus.FINISHED_STOPPED
    p.finish(done, done.status.completed)
    mine, theirs = _req([2, 40, 41], "b", tenant="alice"), _req([2, 40, 41], "c", tenant="bob")
    got = p.propose([mine, theirs], [8, 8])
    assert got[0].tokens == [42, 43, 44, 45] and got[0].match_len == 2
    assert got[1].tokens == []  # bob never sees alice's outputs
    # An aborted request's output is not learned from.
    aborted = _req([1], "d", tenant="bob", out=[40, 41, 50])
    aborted.status = RequestStatus.FINISHED_ABORTED
    p.finish(aborted, aborted.status.completed)
    assert p.propose([theirs], [8])[0].tokens == []


def test_the_policy_speculates_where_steps_cost_their_weights_and_not_where_they_cost_flops() -> None:
    flat = StepCost(np.array([1.0, 64.0, 1024.0]), np.array([0.020, 0.021, 0.5]))
    steep = StepCost(np.array([1.0, 1024.0]), np.array([0.002, 2.0]))  # every token costs the same
    policy = SpecPolicy(num_speculative_tokens=8, cost=flat)
    assert policy.choose(["a"], [8]) == [8]
    # Past the profile's knee (here 16 tokens cost 2.5x one) the step is no longer bound by weight bytes.
    kneed = SpecPolicy(8, cost=StepCost(np.array([1.0, 8.0, 16.0]), np.array([0.020, 0.030, 0.050])))
    assert kneed.knee == 16
    assert kneed.choose(["a"], [8]) != [0] and kneed.choose([str(i) for i in range(16)], [8] * 16) == [0] * 16
    # Beside prompt work that fills the step, a draft would take a prompt token's place: none.
    assert policy.choose(["a"], [8], None, prompt_tokens=5000, budget=1024) == [0]
    assert SpecPolicy(8, cost=steep).choose([str(i) for i in range(64)], [8] * 64) == [0] * 64
    # A request whose drafts keep failing stops speculating where a token costs 3% of a step; the
    # others do not. (On the flat cost even its first drafts still pay.)
    policy = SpecPolicy(num_speculative_tokens=8, cost=StepCost(np.array([1.0, 64.0]), np.array([0.020, 0.060])))
    for _ in range(200):
        policy.record("bad", 8, 8, 0)
        policy.record("good", 8, 8, 8)
    assert policy.choose(["bad", "good"], [8, 8], [8, 8]) == [0, 8]


def test_speculative_config_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="not JSON"):
        SpeculativeConfig.parse("{method: ngram}")
    with pytest.raises(ValueError, match="unknown key.*num_draft_tokens"):
        SpeculativeConfig.parse({"num_draft_tokens": 3})
    with pytest.raises(ValueError, match="method must be one of"):
        SpeculativeConfig.parse('{"method": "eagle"}')
    with pytest.raises(ValueError, match="num_speculative_tokens must be of type int"):
        SpeculativeConfig.parse('{"num_speculative_tokens": "8"}')
    with pytest.raises(ValueError, match="adaptive must be of type bool"):
        SpeculativeConfig.parse('{"adaptive": 1}')
    assert SpeculativeConfig.parse('{"method": "suffix", "suffix_decoding_max_spec_factor": 2}').method == "suffix"


# -- verification -------------------------------------------------------------------------------------------------
def test_greedy_verification_accepts_the_agreeing_prefix_and_adds_one_token() -> None:
    vocab = 6
    argmaxes = [2, 3, 5, 1]  # rows after 0, 1, 2, 3 drafts
    logits = torch.full((4, vocab), -1.0)
    logits[torch.arange(4), torch.tensor(argmaxes)] = 1.0
    r = Request("r", [0], SamplingParams(temperature=0, logprobs=1))
    out = sample(logits, [r], [[2, 3, 4]])
    assert out.token_ids == [[2, 3, 5]]  # the third draft (4) disagrees: row 2's own token replaces it
    assert [lp.token_id for lp in out.logprobs[0]] == [2, 3, 5]
    assert sample(logits, [r], [[2, 3, 5]]).token_ids == [[2, 3, 5, 1]]  # all accepted: a bonus token


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


def test_sampled_verification_keeps_the_target_distribution() -> None:
    torch.manual_seed(0)
    p0 = torch.tensor([0.1, 0.3, 0.2, 0.25, 0.15])
    p1 = torch.tensor([0.4, 0.05, 0.05, 0.3, 0.2])
    logits = torch.stack([p0.log(), p1.log(), p1.log()])
    params = SamplingParams(temperature=1.0)
    first, second = np.zeros(5), np.zeros(5)
    for _ in range(6000):
        tokens = sample(logits.clone(), [Request("r", [0], params)], [[1, 4]]).token_ids[0]
        first[tokens[0]] += 1
        if tokens[0] == 1:  # the first draft was accepted: the second token is row 1's
            second[tokens[1]] += 1
    assert _chi2(first, p0.numpy()) < CHI2_CRITICAL[4]
    assert _chi2(second, p1.numpy()) < CHI2_CRITICAL[4]


# -- the engine -----------------------------------------------------------------------------------------------------
def _greedy(llm, prompts: list[str], max_tokens: int = 64, **extra: object) -> list:  # noqa: ANN001
    return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, **extra))


SETTINGS = {
    "default": {},
    "chunked": {"max_num_batched_tokens": 48, "enable_prefix_caching": False},
    "preemption": {"num_blocks": 30},  # 480 tokens: three prompts (~400 tokens) and their outputs do not fit
}


_UNSPECULATED: dict[str, list[list[int]]] = {}  # setting -> the plain engine's greedy tokens (both methods')


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_outputs_equal_with_and_without_speculation(method: str, setting: str, make_llm) -> None:  # noqa: ANN001
    options = {"dtype": "float32", **SETTINGS[setting]}
    prompts = copy_prompts()
    if setting not in _UNSPECULATED:  # the same engine and prompts for both methods: computed once
        _UNSPECULATED[setting] = [o.outputs[0].token_ids for o in _greedy(make_llm(**options), prompts)]
    expected = _UNSPECULATED[setting]
    llm = make_llm(**options, speculative_config=json.dumps(NGRAM if method == "ngram" else SUFFIX))
    core = llm.engine.core
    preemptions, accepted = core.scheduler.num_preemptions, core.spec.stats.num_accepted_tokens
    assert [o.outputs[0].token_ids for o in _greedy(llm, prompts)] == expected
    assert core.spec.stats.num_accepted_tokens > accepted  # drafts were verified and kept
    if setting == "preemption":
        assert core.scheduler.num_preemptions > preemptions


def test_stop_strings_max_tokens_and_logprobs_stay_exact(make_llm) -> None:  # noqa: ANN001
    prompts = copy_prompts()
    base = make_llm(dtype="float32")
    plain = _greedy(base, prompts, 48)
    # A stop string from the middle of each output: the spec run must end at the same token.
    stops = [o.outputs[0].text[len(o.outputs[0].text) // 2:][:6] for o in plain]
    assert all(len(s) == 6 for s in stops)
    spec = make_llm(dtype="float32", speculative_config=json.dumps(NGRAM))
    for prompt, stop in zip(prompts, stops, strict=True):
        a, b = (_greedy(llm, [prompt], 48, stop=[stop], logprobs=2)[0].outputs[0] for llm in (base, spec))
        assert (b.text, b.token_ids, b.finish_reason, b.stop_reason) == (a.text, a.token_ids, a.finish_reason,
                                                                         a.stop_reason)
        assert [list(lp) for lp in b.logprobs] == [list(lp) for lp in a.logprobs]
        assert [lp[t].logprob for lp, t in zip(b.logprobs, b.token_ids, strict=True)] == pytest.approx(
            [lp[t].logprob for lp, t in zip(a.logprobs, a.token_ids, strict=True)], abs=1e-4)
    for max_tokens in (1, 2, 7):
        outs = _greedy(spec, prompts, max_tokens, ignore_eos=True)
        assert [len(o.outputs[0].token_ids) for o in outs] == [max_tokens] * len(prompts)


def test_logit_bias_applies_to_every_verified_row(make_llm) -> None:  # noqa: ANN001
    """A bias moves the target distribution; verification must score drafts against the moved one, so
    greedy and seeded outputs equal the unspeculated run's, with drafts accepted."""
    prompts = copy_prompts()
    base = make_llm(dtype="float32")
    plain = [o.outputs[0].token_ids for o in _greedy(base, prompts, 40)]
    banned = {max(set(ids), key=ids.count): -100.0 for ids in plain}  # each output's most frequent token
    spec = make_llm(dtype="float32", speculative_config=json.dumps(NGRAM))
    for temperature, seed in ((0.0, None), (0.8, 7)):
        params = SamplingParams(temperature=temperature, seed=seed, max_tokens=40, logit_bias=banned)
        expected = [o.outputs[0].token_ids for o in base.generate(prompts, params)]
        accepted = spec.engine.core.spec.stats.num_accepted_tokens
        assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == expected
        assert spec.engine.core.spec.stats.num_accepted_tokens > accepted
        assert not any(t in banned for ids in expected for t in ids)
    assert expected != plain


def test_rejected_drafts_never_reach_the_prefix_cache(make_llm) -> None:  # noqa: ANN001
    """Every block the speculating engine cached holds the KV a plain engine computes for the same
    tokens (a rejected draft's KV would be another token's), and drafts were rejected on the way."""
    prompts = copy_prompts()
    base = make_llm(dtype="float32", num_blocks=256)
    spec = make_llm(dtype="float32", num_blocks=256, speculative_config=json.dumps(NGRAM))
    for llm in (base, spec):
        llm.engine.core.scheduler.kv.reset_prefix_cache()
    stats = spec.engine.core.spec.stats
    drafts, accepted = stats.num_draft_tokens, stats.num_accepted_tokens
    assert [o.outputs[0].token_ids for o in _greedy(spec, prompts, 80)] == \
        [o.outputs[0].token_ids for o in _greedy(base, prompts, 80)]
    assert stats.num_draft_tokens - drafts > stats.num_accepted_tokens - accepted  # some were rejected
    pools = [llm.engine.core.scheduler.kv.pool for llm in (base, spec)]
    cached = [{h: b.block_id for h, b in pool.cached.items()} for pool in pools]
    assert set(cached[1]) == set(cached[0]) and cached[1]
    kv_base, kv_spec = (llm.engine.core.runner.kv_caches for llm in (base, spec))
    for h, block in cached[1].items():
        torch.testing.assert_close(kv_spec[:, :, block], kv_base[:, :, cached[0][h]], atol=1e-4, rtol=1e-4)


def test_seeded_sampling_does_not_depend_on_speculation(make_llm) -> None:  # noqa: ANN001
    prompts = copy_prompts()
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=40) for s in (1, 2, 3)]
    base = make_llm(dtype="float32")
    spec = make_llm(dtype="float32", speculative_config=json.dumps(SUFFIX))
    expected = [o.outputs[0].token_ids for o in base.generate(prompts, params)]
    accepted = spec.engine.core.spec.stats.num_accepted_tokens
    for _ in range(2):
        assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == expected
    assert spec.engine.core.spec.stats.num_accepted_tokens > accepted


def test_sampled_outputs_follow_transformers_probabilities_on_a_tiny_model(tmp_path: Path, make_llm) -> None:  # noqa: ANN001
    """The first three sampled tokens over many seeds, speculating on a prompt that holds every token
    (so whatever comes first, a draft follows it), against their exact distribution from transformers."""
    vocab = 16
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    ref = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    ref.save_pretrained(tmp_path / "tiny", safe_serialization=True)
    prompt = list(range(vocab)) * 2 + [0, 1, 2]
    with torch.inference_mode():
        def next_probs(prefixes: list[list[int]]) -> torch.Tensor:
            return ref(torch.tensor(prefixes)).logits[:, -1].double().softmax(-1)

        p1 = next_probs([prompt])[0]
        p2 = next_probs([prompt + [a] for a in range(vocab)])  # [t1, t2]
        p3 = next_probs([prompt + [a, b] for a in range(vocab) for b in range(vocab)]).view(vocab, vocab, vocab)
    joint2 = p1[:, None] * p2
    marginals = [p1, joint2.sum(0), (joint2[:, :, None] * p3).sum((0, 1))]
    llm = make_llm(model=str(tmp_path / "tiny"), dtype="float32", num_blocks=1024, block_size=4,
                   speculative_config=json.dumps({**NGRAM, "prompt_lookup_min": 1}))
    n = 4000
    outs = llm.generate([prompt] * n, [SamplingParams(temperature=1.0, seed=s, max_tokens=3, ignore_eos=True)
                                       for s in range(n)])
    tokens = np.array([o.outputs[0].token_ids for o in outs])
    stats = llm.engine.core.spec.stats
    assert stats.num_draft_tokens > n / 2 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    for position, probs in enumerate(marginals):
        counts = np.bincount(tokens[:, position], minlength=vocab)
        assert _chi2(counts, probs.numpy()) < CHI2_CRITICAL[15], position


@pytest.mark.slow
def test_decode_workers_of_a_1p1d_deployment_speculate_losslessly(make_llm, shared_server) -> None:  # noqa: ANN001
    """Greedy and seeded outputs through a router, a prefill and a speculating decode worker (the session's
    1P1D deployment) equal the offline engine's without speculation; the router's /metrics counts the decode
    worker's drafts."""
    import openai

    prompts = copy_prompts()
    base = make_llm(dtype="float32", kv_cache_memory=0.25, max_num_batched_tokens=64)
    greedy = [o.outputs[0].text for o in _greedy(base, prompts, 48)]
    seeded_params = [SamplingParams(temperature=0.8, seed=7, max_tokens=32) for _ in prompts]
    seeded = [o.outputs[0].text for o in base.generate(prompts, seeded_params)]
    s = shared_server(*FP32_1P1D)
    client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    for prompt, text in zip(prompts, greedy, strict=True):
        assert client.completions.create(model=model, prompt=prompt, max_tokens=48, temperature=0
                                         ).choices[0].text == text
    for prompt, text in zip(prompts, seeded, strict=True):
        assert client.completions.create(model=model, prompt=prompt, max_tokens=32, temperature=0.8, seed=7
                                         ).choices[0].text == text
    # Streaming delivers accepted drafts as they arrive and adds up to the same text.
    stream = client.completions.create(model=model, prompt=prompts[0], max_tokens=48, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == greedy[0]
    assert s.metric("spec_decode_num_accepted_tokens_total") > 0
    assert s.metric("spec_decode_num_draft_tokens_total") >= s.metric("spec_decode_num_accepted_tokens_total")
