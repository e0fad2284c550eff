"""The suffix index of training answers: lookups on hand-built corpora, its file, and the hybrid drafter with it
as a second n-gram source (greedy exact, lossless sampling)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import selfspec
from selfspec.decode.drafters import DraftTree, PromptLookupDrafter
from selfspec.decode.drafters import suffix_index as suffix_module
from selfspec.decode.drafters.base import AcceptedPath
from selfspec.decode.drafters.hybrid import HybridDrafter, merge_chain
from selfspec.decode.drafters.suffix_index import SuffixIndex, ngram_hashes
from selfspec.decode.loop import speculative_generate
from selfspec.decode.rejection import verify_tree_sampling
from selfspec.heads.eagle import EagleConfig, EagleHead
from tests.helpers.archs import tiny_target
from tests.helpers.decoding import V
from tests.helpers.drafters import NO_LIMIT, Rigged, TargetTopKDrafter, cost, eagle_hybrid
from tests.helpers.lossless import assert_lossless, enumerate_law, tree_case
from tests.helpers.sampling import SAMPLING, processed_probs
from tests.helpers.stats import chi2_critical, pooled_chi2

CORPUS = [
    [1, 2, 3, 4, 5, 6],
    [9, 2, 3, 4, 7],
    [8, 2, 3, 4, 5, 0],
    [3, 4, 5, 6, 1, 1],
]


def test_longest_match_wins_and_the_majority_path_is_followed():
    index = SuffixIndex(CORPUS, min_ngram=1, max_ngram=4)
    # "2 3 4" occurs three times, followed by 5, 7, 5: the majority 5, then 6 (seq 0) vs 0 (seq 2): tie -> 0
    assert index.lookup([7, 2, 3, 4], 4) == ([5, 0], 3)
    # "1 2 3 4" occurs once (the longer match wins over the three of "2 3 4"): its own continuation
    assert index.lookup([1, 2, 3, 4], 4) == ([5, 6], 4)
    # "3 4 5": seq 0 (-> 6), seq 2 (-> 0), seq 3 (-> 6, 1, 1): 6 twice, then 1 is all that is left
    assert index.lookup([3, 4, 5], 8) == ([6, 1, 1], 3)
    assert index.lookup([3, 4, 5], 1) == ([6], 3)
    assert index.lookup([42, 43], 4) == ([], 0)  # no match at any n
    assert index.lookup([1, 2], 0) == ([], 0)
    assert SuffixIndex([]).lookup([1, 2], 4) == ([], 0)


def test_support_cutoff_stops_the_path_and_falls_back_to_a_shorter_match():
    index = SuffixIndex(CORPUS, min_ngram=1, max_ngram=4, min_support=2)
    # "2 3 4": 5 has two votes (kept), then 6 vs 0 one each: stop
    assert index.lookup([7, 2, 3, 4], 4) == ([5], 3)
    # "1 2 3 4" occurs once: under the support of 2, so the shorter "2 3 4" serves
    assert index.lookup([1, 2, 3, 4], 4) == ([5], 3)
    assert SuffixIndex(CORPUS, min_ngram=1, max_ngram=4, min_support=4).lookup([2, 3, 4], 4) == ([], 0)


def test_a_continuation_never_crosses_into_the_next_answer():
    index = SuffixIndex([[5, 6, 7], [8, 9]], min_ngram=1, max_ngram=3)
    assert index.lookup([5, 6], 4) == ([7], 2)  # seq 0 ends: 8 9 of the next one never follow
    assert index.lookup([6, 7], 4) == ([], 0)  # "6 7" ends its answer: nothing follows it
    assert index.lookup([7], 4) == ([], 0)
    assert index.lookup([0, 8], 4) == ([9], 1)


def test_hash_collisions_return_only_true_matches(monkeypatch):
    """Every n-gram hashes alike: each lookup still returns what the real hash returns."""
    real = SuffixIndex(CORPUS, min_ngram=1, max_ngram=4, max_occurrences=2)
    contexts = ([7, 2, 3, 4], [1, 2, 3, 4], [3, 4, 5], [42, 43], [6, 1], [5])
    expected = [real.lookup(ctx, 5) for ctx in contexts]
    assert expected[0] == ([5, 6], 3)  # the first two occurrences of "2 3 4" vote: 5, then 6 (seq 0) vs 7
    monkeypatch.setattr(
        suffix_module, "ngram_hashes", lambda t, n: torch.zeros(max(t.numel() - n + 1, 0), dtype=torch.long)
    )
    colliding = SuffixIndex(CORPUS, min_ngram=1, max_ngram=4, max_occurrences=2)
    assert colliding._tables[3][0].unique().tolist() == [0]
    assert [colliding.lookup(ctx, 5) for ctx in contexts] == expected
    assert colliding.lookup([42, 43], 5) == ([], 0)


def test_hashes_differ_by_order_and_match_per_window():
    t = torch.tensor([4, 5, 4, 5, 5, 4])
    h = ngram_hashes(t, 2)
    assert h.shape == (5,) and h[0] == h[2] and h[0] != h[1] and h[1] != h[3]
    assert h[3] == ngram_hashes(torch.tensor([5, 5]), 2)[0]
    assert ngram_hashes(t, 7).numel() == 0


def test_save_load_round_trip(tmp_path):
    index = SuffixIndex(CORPUS, min_ngram=2, max_ngram=3)
    path = index.save(tmp_path / "sub" / "index.safetensors")
    back = SuffixIndex.load(path)
    assert back.tokens.dtype == torch.int32 and torch.equal(back.tokens, index.tokens)
    assert back.lengths.tolist() == [6, 5, 6, 6] and (back.min_ngram, back.max_ngram) == (2, 3)
    for ctx in ([7, 2, 3, 4], [3, 4, 5], [1, 1]):
        assert back.lookup(ctx, 5) == index.lookup(ctx, 5)
    assert [p.name for p in path.parent.iterdir()] == ["index.safetensors"]  # no temporary file left
    assert SuffixIndex.open(str(path)).lookup([3, 4, 5], 5) == index.lookup([3, 4, 5], 5)


def test_corrupt_truncated_and_foreign_files_are_refused(tmp_path):
    path = SuffixIndex(CORPUS).save(tmp_path / "index.safetensors")
    data = path.read_bytes()
    cases = {}
    (tmp_path / "truncated.safetensors").write_bytes(data[:-7])
    cases["truncated"] = "truncated or corrupt"
    flipped = bytearray(data)
    flipped[-3] ^= 0x01  # a token's byte: still a well-formed file
    (tmp_path / "flipped.safetensors").write_bytes(bytes(flipped))
    cases["flipped"] = "checksum"
    tensors = load_file(path)
    with open(path, "rb") as f:  # the stored metadata, edited
        meta = json.loads(f.read(8 + int.from_bytes(data[:8], "little"))[8:])["__metadata__"]
    save_file(tensors, tmp_path / "version.safetensors", metadata={**meta, "format_version": "9"})
    cases["version"] = "format version 1"
    save_file({"weight": torch.zeros(2)}, tmp_path / "other.safetensors", metadata={"format": "pt"})
    cases["other"] = "not a selfspec suffix index"
    lengths = tensors["lengths"].clone()
    lengths[0] += 1
    bad = {"tokens": tensors["tokens"], "lengths": lengths}
    from selfspec.heads.io import tensor_digest

    save_file(bad, tmp_path / "lengths.safetensors", metadata={**meta, "sha256": tensor_digest(bad)})
    cases["lengths"] = "do not cover the tokens"
    for name, message in cases.items():
        with pytest.raises(ValueError, match=message) as err:
            SuffixIndex.load(tmp_path / f"{name}.safetensors")
        assert "SuffixIndex.from_jsonl" in str(err.value), name  # the fix is named
    with pytest.raises(ValueError, match="cannot read suffix index .*missing.safetensors: the file is missing; "):
        SuffixIndex.load(tmp_path / "missing.safetensors")


class WordTokenizer:
    """``encode`` of whitespace-separated integers (ids as text); special tokens would add a 1 in front."""

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [int(w) for w in text.split()]

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(str(i) for i in ids)


def test_from_jsonl_indexes_the_assistant_answers_only(tmp_path):
    records = [
        {"id": "a", "messages": [{"role": "user", "content": "50 51"}, {"role": "assistant", "content": "5 6 7"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "52"}, {"from": "gpt", "value": "8 9"}]},
    ]
    path = tmp_path / "conv.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    index = SuffixIndex.from_jsonl(WordTokenizer(), path, min_ngram=1)
    assert index.tokens.tolist() == [5, 6, 7, 8, 9] and index.lengths.tolist() == [3, 2]
    assert SuffixIndex.open(path, WordTokenizer(), min_ngram=1).tokens.tolist() == [5, 6, 7, 8, 9]
    with pytest.raises(ValueError, match="needs the target's tokenizer"):
        SuffixIndex.open(path)
    path.write_text('{"id": "x", "text": "5 6"}\n')
    with pytest.raises(ValueError, match="neither a 'messages' list"):
        SuffixIndex.from_jsonl(WordTokenizer(), path)
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        SuffixIndex([[3, 200]]).check_vocab(V)


# ------------------------------------------------------------------------------------------- the hybrid
def test_the_index_chain_is_drafted_when_the_context_has_no_match():
    index = SuffixIndex([[60, 61, 12, 13, 40, 41, 42], [12, 13, 40, 50]], min_ngram=2, max_ngram=4)
    h = HybridDrafter(Rigged(), cost(0.05).verify_cost_ms, PromptLookupDrafter(num_tokens=4), suffix_index=index)
    h.begin(torch.tensor([10]), torch.zeros(1, 4))
    ctx = torch.tensor([10, 11, 12, 13])  # no token repeats: prompt lookup finds nothing
    tree = h.propose(ctx, None, None, NO_LIMIT)
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    assert tokens[:5] == [13, 1, 1, 2, 2]  # the head's tree first
    assert tokens[5:] == [40, 41, 42] and parents[5:] == [0, 5, 6]  # then the index's chain under the root
    assert h._last[3] == -2  # recorded apart from context chains
    h.accept(AcceptedPath(tree, (0, 5, 6), torch.tensor([13, 40, 41]), torch.zeros(3, 4), 42))
    assert h.acceptance.chain_reached == {-2: [1, 1, 0]} and h.acceptance.chain_drafted == {-2: [1, 1, 1]}
    # a context match as long as the index's wins the tie; a longer index match wins
    index = SuffixIndex([[5, 6, 7, 60], [8, 5, 6, 7, 70]], min_ngram=2, max_ngram=6)
    h = HybridDrafter(Rigged(), cost(0.05).verify_cost_ms, PromptLookupDrafter(num_tokens=4), suffix_index=index)
    h.begin(torch.tensor([5]), torch.zeros(1, 4))
    h.propose(torch.tensor([5, 6, 7, 9, 5, 6, 7]), None, None, NO_LIMIT)
    assert h._last[3] == 3 and 9 in h._last[0].tokens.tolist()[5:]
    h.propose(torch.tensor([8, 5, 6, 7, 9, 5, 6, 7]), None, None, NO_LIMIT)
    assert h._last[3] == 3  # "5 6 7" in both: the context's
    h.propose(torch.tensor([1, 8, 5, 6, 7]), None, None, NO_LIMIT)
    assert h._last[3] == -4 and h._last[0].tokens.tolist()[5:] == [70]
    assert h.fork().suffix_index is index


def test_the_source_accepted_more_often_wins_over_the_longer_match():
    """Once this decode has seen the index's 4-gram chains refused and the context's 3-gram chains accepted, the
    context's chain is drafted although the index matches one token more; before that, the longer match."""
    index = SuffixIndex([[5, 6, 7, 60], [8, 5, 6, 7, 70]], min_ngram=2, max_ngram=6)
    h = HybridDrafter(Rigged(), cost(0.05).verify_cost_ms, PromptLookupDrafter(num_tokens=4), suffix_index=index)
    h.begin(torch.tensor([5]), torch.zeros(1, 4))
    ctx = torch.tensor([5, 6, 7, 9, 8, 5, 6, 7])  # context: "5 6 7" -> 9; index: "8 5 6 7" -> 70
    h.propose(ctx, None, None, NO_LIMIT)
    assert h._last[3] == -4
    for _ in range(3):
        h.acceptance.record_chain(-4, 1, 0)
        h.acceptance.record_chain(3, 1, 1)
    h.propose(ctx, None, None, NO_LIMIT)
    assert h._last[3] == 3 and h._last[0].tokens.tolist()[5:6] == [9]


def random_prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, V, (length,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_equals_generate_with_an_index(arch):
    """An index holding the target's own answers (accepted) and near copies that leave them (rejected)."""
    t = tiny_target(arch)
    prompts = [random_prompt(n, s) for s, n in ((0, 10), (1, 21))]
    refs = [
        t.generate(p[None], max_new_tokens=20, do_sample=False, pad_token_id=0, top_k=None)[0, p.numel() :].tolist()
        for p in prompts
    ]
    g = torch.Generator().manual_seed(5)
    answers = []
    for p, ref in zip(prompts, refs, strict=True):
        answers.append(p[-4:].tolist() + ref)
        wrong = list(ref)
        for at in (3, 9, 15):
            wrong[at] = int(torch.randint(3, V, (1,), generator=g))
        answers.append(p[-4:].tolist() + wrong)
    index = SuffixIndex(answers, min_ngram=2, max_ngram=6, min_support=1)
    for p, ref in zip(prompts, refs, strict=True):
        drafter = eagle_hybrid(t)
        drafter.suffix_index = index
        out = speculative_generate(t, drafter, p, max_new_tokens=20)
        assert out.tokens == ref
        assert any(k < 0 for k in drafter.acceptance.chain_drafted)  # the index's chains were drafted
        assert any(sum(r) for k, r in drafter.acceptance.chain_reached.items() if k < 0)  # and accepted


def test_exact_sampling_through_a_tree_with_an_index_chain():
    """Enumerated as tests/decode/test_hybrid.py: a head tree merged with the index's chain (the majority
    continuation of the root token), V = 6: the emitted law is exactly prod p over every 4-token sequence."""
    from tests.helpers.lossless import target

    v, prefix0 = 6, (3,)
    a, b = torch.topk(target(prefix0, v), 2).indices.tolist()
    c, d = torch.topk(target(prefix0 + (a,), v), 2).indices.tolist()
    head = DraftTree(tokens=torch.tensor([3, a, b, c, d]), parents=torch.tensor([-1, 0, 0, 1, 1]))
    e = int(torch.argsort(target(prefix0 + (a, c), v))[-2])
    index = SuffixIndex([[3, a, c, e], [3, a, c, e, b], [3, b]], min_ngram=1, max_ngram=2)
    chain, n = index.lookup(list(prefix0), 3)
    assert (chain, n) == ([a, c, e], 1)
    merged, path = merge_chain(head, chain)
    tokens, parents = merged.tokens.tolist(), merged.parents.tolist()
    _, p, _ = tree_case(parents, tokens, prefix0, v, None)

    def run(source):
        result = verify_tree_sampling(p, merged.tokens, merged.parents, None, source)
        return tuple(tokens[j] for j in result.accepted_nodes[1:].tolist()) + (result.next_token,)

    assert_lossless(enumerate_law(run), prefix0, v, 4, expect_longest=4)


@pytest.mark.slow  # over 5 s: the whole suite runs it
def test_sampling_keeps_the_target_distribution_with_an_index():
    """Seeded chi-square as tests/decode/test_hybrid.py, the index holding the target's likely and unlikely
    continuations of the prompt's tail, N = 300, alpha = 0.001."""
    t = tiny_target("llama")
    ids = random_prompt(12, 3)
    p1 = processed_probs(t, ids)
    expected = {}
    for x1 in p1.nonzero().flatten().tolist():
        p2 = processed_probs(t, torch.cat([ids, torch.tensor([x1])]))
        for x2 in p2.nonzero().flatten().tolist():
            expected[(x1, x2)] = float(p1[x1] * p2[x2])
    top, low = int(p1.argmax()), int(p1.argmin())
    tail = ids[-3:].tolist()
    index = SuffixIndex([tail + [top, 7, 8], tail + [top, 7], tail + [low, 9]], min_ngram=2, max_ngram=3)
    gen = torch.Generator().manual_seed(99)
    counts, chains, n = {}, 0, 300
    for _ in range(n):
        drafter = HybridDrafter(TargetTopKDrafter(t), cost(0.0).verify_cost_ms, suffix_index=index)
        out = speculative_generate(t, drafter, ids, max_new_tokens=3, sampling=SAMPLING, generator=gen)
        key = (out.tokens[0], out.tokens[1])
        assert key in expected
        counts[key] = counts.get(key, 0) + 1
        chains += sum(sum(d) for k, d in drafter.acceptance.chain_drafted.items() if k < 0)
    chi2, dof = pooled_chi2(counts, expected, n)
    assert dof >= 2 and chi2 < chi2_critical(dof), chi2
    assert chains > 0


# ---------------------------------------------------------------------------------------- public API
def test_public_load_takes_an_index_file_or_conversations(tmp_path):
    t = tiny_target("llama")
    torch.manual_seed(1)
    head = EagleHead(EagleConfig(hidden_size=t.config.hidden_size, vocab_size=V), t.config, target=t).eval()
    ids = random_prompt(10, 0)
    ref = t.generate(ids[None], max_new_tokens=12, do_sample=False, pad_token_id=0, top_k=None)[0, 10:].tolist()
    saved = SuffixIndex([ids[-3:].tolist() + ref]).save(tmp_path / "index.safetensors")
    conv = tmp_path / "conv.jsonl"
    answer = " ".join(str(x) for x in ids[-3:].tolist() + ref)
    conv.write_text(json.dumps({"id": "a", "messages": [{"role": "assistant", "content": answer}]}) + "\n")
    options = dict(hybrid=True, tune="off", depth=3, top_k=2, total_tokens=5)
    for source in (saved, str(saved), conv):
        model = selfspec.load(t, head, tokenizer=WordTokenizer(), suffix_index=source, **options)
        assert isinstance(model.drafter, HybridDrafter) and model.drafter.suffix_index.tokens.tolist()[3:] == ref
        assert model.generate(ids, max_new_tokens=12).tokens == ref
        assert any(k < 0 for k in model.drafter.acceptance.chain_drafted)
    with pytest.raises(ValueError, match="suffix_index=... is a source of the hybrid drafter: pass hybrid=True"):
        selfspec.load(t, head, suffix_index=saved, tune="off")
    with pytest.raises(ValueError, match="needs the target's tokenizer"):
        selfspec.load(t, head, suffix_index=conv, **options)


# ---------------------------------------------------------------------------------------------- bench
def test_bench_adds_hybrid_suffix_beside_hybrid(tmp_path, monkeypatch):
    """``--suffix-index PATH`` with ``--methods hybrid``: the index holds the target's own answers, and the
    hybrid_suffix outputs equal plain generate's."""
    from selfspec.api import make_verifier
    from selfspec.bench import BenchPrompt, BenchSettings, build_methods, run_bench
    from selfspec.bench import cli as bench_cli
    from selfspec.bench import methods as bench_methods
    from tests.helpers.tokenizers import CharTokenizer

    monkeypatch.setattr(bench_methods, "get_cost_profile", lambda target: cost())
    monkeypatch.setattr(bench_methods, "make_verifier", lambda target, drafter: make_verifier(target, drafter, "off"))
    t, tokenizer = tiny_target("llama"), CharTokenizer()
    torch.manual_seed(1)
    head = EagleHead(EagleConfig(hidden_size=t.config.hidden_size, vocab_size=V), t.config, target=t).eval()
    settings = BenchSettings(max_new_tokens=12, warmup=0, eos_token_ids=())
    prompts = [BenchPrompt("a", "x", ("hello there",)), BenchPrompt("b", "y", ("a b c",))]
    plain = run_bench(t, tokenizer, build_methods(t, tokenizer, settings, methods=["baseline"]), prompts, settings)
    answers = [tokenizer.encode_text("<assistant>") + s.results["baseline"].tokens for s in plain.samples]
    saved = SuffixIndex(answers).save(tmp_path / "index.safetensors")
    options = dict(methods=["baseline", "hybrid"], heads={"eagle": head}, eagle_options={"depth": 3, "top_k": 2})
    methods = build_methods(t, tokenizer, settings, suffix_index=str(saved), **options)
    assert list(methods) == ["baseline", "no_draft", "hybrid", "hybrid_suffix", "eagle"]
    assert "suffix index of" in methods["hybrid_suffix"].description
    report = run_bench(t, tokenizer, methods, prompts, settings).to_dict()
    assert report["mismatches"] == []
    for sample in report["samples"]:
        results = sample["results"]
        assert results["hybrid_suffix"]["tokens"] == results["baseline"]["tokens"]
        assert results["hybrid_suffix"]["steps"] < results["hybrid"]["steps"]  # the index's answers were accepted
    with pytest.raises(ValueError, match="--suffix-index adds hybrid_suffix beside the hybrid method"):
        build_methods(t, tokenizer, settings, methods=["baseline"], heads={"eagle": head}, suffix_index=str(saved))
    args = bench_cli.build_parser().parse_args(["--methods", "hybrid", "--suffix-index", str(saved)])
    assert args.suffix_index == str(saved)
