"""`rlora serve` runs a forward_backward's data that begin alike as trees (serve/shared_prefix.py): the longest runs
whole, the others only their tokens after the prefix they share with it, on its cache. The planning on its own; the
log-probs and gradients against the data run apart (float64: to float32's resolution, which the log-softmax and
RMSNorm run in; several families); and a client's multi-turn data through the server against the same data with
trees off (outputs, loss and the adapter after an optim_step within 1e-5)."""

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_serve_batching import ADAM, held, server, wait_for  # noqa: F401 - server: the module's fixture
from tinker import types

from rlora.config import ModelConfig
from rlora.models.loading import load_base_model
from rlora.models.tiny import build_random_model
from rlora.serve import datum_rows, proto
from rlora.serve import worker as worker_module
from rlora.serve.logprobs import sequence_logprobs
from rlora.serve.shared_prefix import Tree, TreePass, prefix_trees, sharing_unsupported

pytestmark = pytest.mark.filterwarnings("ignore:.*tie_word_embeddings", "ignore:.*past_key_values")


def test_data_join_the_root_they_share_the_longest_prefix_with():
    a = list(range(100, 160))  # 60 tokens
    b = a[:40] + [1] * 10  # shares 40 with a
    c = a[:50]  # a prefix of a
    d = list(range(200, 230))  # shares nothing
    e = b + [2] * 30  # longer than a, shares 50 with b and 40 with a
    f = a[:20] + [3] * 20  # shares 20: under the minimum of 32
    # e (80 tokens) is the first root; a joins it (40 shared), b too (50), c too (40: it shares 50 with a, but a
    # member is no root: one level, which serves a multi-turn chain, where each turn shares all but its end with the
    # last); f shares 20 (under the minimum), d nothing
    trees, alone = prefix_trees([a, b, c, d, e, f], min_shared=32)
    assert [(t.root, sorted(zip(t.members, t.shared))) for t in trees] == [(4, [(0, 40), (1, 50), (2, 40)])]
    assert alone == [3, 5]
    trees, alone = prefix_trees([a, c, d], min_shared=16)
    assert [(t.root, t.members, t.shared) for t in trees] == [(0, [1], [50])] and alone == [2]
    assert prefix_trees([a, a], min_shared=32)[0] == [Tree(0, [1], [60])]  # equal data: the whole of it shared
    assert prefix_trees([d[:10], d[:10]], min_shared=32) == ([], [0, 1])  # shorter than the minimum


def _rows(data, targets_of):
    width = max(map(len, data))
    ids, mask, targets = (torch.zeros(len(data), width, dtype=torch.long) for _ in range(3))
    for b, row in enumerate(data):
        ids[b, :len(row)], mask[b, :len(row)] = torch.tensor(row), 1
        targets[b, :len(row)] = torch.tensor(targets_of(row))
    return ids, mask, targets


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "phi3", "qwen3_moe"])
def test_a_trees_logprobs_and_gradients_are_those_of_its_data_run_apart(tmp_path, family):
    path = str(build_random_model(tmp_path / "m", family=family, seed=0))
    # float64 where the family runs it (the mixture's grouped expert products run float32 at most)
    dtype = torch.float32 if family == "qwen3_moe" else torch.float64
    base = load_base_model(ModelConfig(path=path), path).to(dtype)
    targets = ["q_proj", "v_proj", "o_proj", "lm_head"] + (["down_proj"] if family != "qwen3_moe" else [])
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    assert sharing_unsupported(model, 64) is None
    g = torch.Generator().manual_seed(1)
    root = torch.randint(3, 90, (60,), generator=g).tolist()
    data = [root,
            root[:40] + torch.randint(3, 90, (15,), generator=g).tolist(),  # its own tail
            root[:50],  # a prefix of the root: nothing of its own runs
            root[:45] + torch.randint(3, 90, (3,), generator=g).tolist()]
    ids, mask, targets = _rows(data, lambda row: row[1:] + [7])
    targets[2, 10] = 5  # a shared position whose target is not the root's
    weights = torch.randn(ids.shape, dtype=torch.float64, generator=g) * mask

    def grads():
        return [p.grad.clone() for p in model.parameters() if p.requires_grad]

    def as_tree(max_tokens):
        """The tree's chunks, each chunk's loss backward before the next, then the root's backward."""
        model.zero_grad()
        tree, logp = TreePass(model, ids, mask, targets, [60, 40, 50, 45]), torch.zeros(ids.shape)
        chunks = []
        for rows, logp_nT in tree.chunks(max_tokens):
            (logp_nT.double() * weights[rows]).sum().backward()
            logp[rows], chunks = logp_nT.detach(), chunks + [rows]
        tree.finish()
        return logp, grads(), chunks

    model.zero_grad()
    apart = sequence_logprobs(model, ids, mask, targets)
    (apart.double() * weights).sum().backward()
    apart, grads_apart = apart.detach(), grads()
    tree, grads_tree, chunks = as_tree(max_tokens=1 << 20)
    assert chunks == [[0, 1, 2, 3]] and torch.equal(tree == 0, mask == 0)
    # float64: the log-softmax's float32 output; float32: rounding of other product shapes as well
    torch.testing.assert_close(tree, apart, atol=2e-6 if dtype == torch.float64 else 1e-5, rtol=0)
    scale = max(float(g.abs().max()) for g in grads_apart)
    for a, b in zip(grads_apart, grads_tree):  # float32's resolution (RMSNorm, log-softmax), relative to the largest
        torch.testing.assert_close(b, a, atol=(1e-6 if dtype == torch.float64 else 1e-5) * scale, rtol=0)
    # a chunk a row (the root's log-probs, keys and values gather every chunk's gradient): the same numbers
    chunked, grads_chunked, chunks = as_tree(max_tokens=15)
    # 15 own tokens (row 1) and 3 (row 3, padded to 15 beside row 1): each fits alone, not with the other; row 2
    # has none of its own and joins the chunk at hand
    assert chunks == [[0, 1, 2], [3]]
    torch.testing.assert_close(chunked, apart, atol=2e-6 if dtype == torch.float64 else 1e-5, rtol=0)
    for a, b in zip(grads_apart, grads_chunked):  # (the output layer's float32 runs over other chunks of positions)
        torch.testing.assert_close(b, a, atol=(1e-6 if dtype == torch.float64 else 1e-5) * scale, rtol=0)
    again, grads_again, _ = as_tree(max_tokens=1 << 20)
    assert torch.equal(again, tree) and all(torch.equal(a, b) for a, b in zip(grads_again, grads_tree))


def test_a_sliding_window_within_the_data_runs_them_apart(tmp_path):
    path = str(build_random_model(tmp_path / "m", family="mistral", seed=0, sliding_window=16))
    model = load_base_model(ModelConfig(path=path), path)
    assert sharing_unsupported(model, 15) is None
    # a sliding layer's cache keeps the last 15 keys only: a root of 16 tokens would lose its first (found by review:
    # log-probs 0.028 off)
    assert sharing_unsupported(model, 16) == "a sliding window of 16 positions within the data's 16"
    assert sharing_unsupported(model, 40) == "a sliding window of 16 positions within the data's 40"


def _episode(rng, turns=4, first=40, reply=8, observation=6):
    """A multi-turn client's data as a cookbook loop sends them when turns do not extend each other: datum k holds the
    history up to turn k's reply, advantages on the reply only."""
    data, history = [], rng.integers(3, 90, first).tolist()
    for _ in range(turns):
        reply_tokens = rng.integers(3, 90, reply).tolist()
        tokens = history + reply_tokens
        n = len(tokens) - 1
        advantages = np.zeros(n, dtype=np.float32)
        advantages[-reply:] = rng.normal()
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
            "target_tokens": tokens[1:], "logprobs": rng.normal(-3, 0.5, n).astype(np.float32),
            "advantages": advantages}))
        # the reply's last two tokens rendered again as another: the next data share all of this one's but its last
        history = tokens[:-2] + [int(rng.integers(3, 90))] + rng.integers(3, 90, observation).tolist()
    return data


def test_a_clients_multi_turn_data_train_as_trees_as_they_do_apart(server, monkeypatch):
    worker, rng = server.worker, np.random.default_rng(0)
    data = _episode(rng) + _episode(rng) + [_episode(rng, turns=1, first=20)[0]]  # two trees and a datum alone
    tokens = [d.model_input.to_ints() for d in data]
    trees, alone = prefix_trees(tokens)
    assert len(trees) == 2 and alone == [8] and all(len(t.members) == 3 for t in trees)
    ran = []

    class Counted(TreePass):
        def chunks(self, max_tokens):
            for chunk in super().chunks(max_tokens):
                ran.append(len(chunk[0]))
                yield chunk

    monkeypatch.setattr(worker_module, "TreePass", Counted)
    # forwards of one token: a tree's members (one token of their own each) run a chunk each, the data apart one by one
    monkeypatch.setattr(datum_rows, "CPU_MICRO_BATCH_TOKENS", 1)
    results, default = {}, worker.min_shared_prefix
    for way, min_shared in (("trees", default), ("apart", None)):
        client = server.service.create_lora_training_client(base_model=server.model, rank=4, seed=5)
        params = worker.trainees[client.model_id].params
        start = [p.detach().clone() for p in params]  # the same seed: the same start for both ways
        worker.min_shared_prefix = min_shared
        try:
            out = client.forward_backward(data, "importance_sampling").result(timeout=120)
            client.optim_step(ADAM).result(timeout=60)
            after = client.forward(data, "importance_sampling").result(timeout=120)  # forward only, the new adapter
        finally:
            worker.min_shared_prefix = default
        assert all(p.grad is None for p in params)  # optim_step cleared them; the forward added none
        results[way] = (out, [p.detach().clone() for p in params], start, after)
    assert ran == [2, 1, 1] * 4  # trees ran (a member a chunk) for the forward_backward and the forward, trees way only
    (trees_out, trees_params, start, trees_after), (apart_out, apart_params, _, apart_after) = results.values()
    np.testing.assert_allclose(trees_out.metrics["loss:sum"], apart_out.metrics["loss:sum"], rtol=1e-5)
    for a, b in zip(trees_out.loss_fn_outputs + trees_after.loss_fn_outputs,
                    apart_out.loss_fn_outputs + apart_after.loss_fn_outputs):
        np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), atol=1e-5)
    for a, b, before in zip(trees_params, apart_params, start):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    # the step moved the adapter (its B matrices: A gets no gradient while B is still zero)
    assert sum(not torch.equal(a, before) for a, before in zip(trees_params, start)) >= len(start) // 2


def test_data_that_begin_alike_run_alone_not_batched_with_other_clients(server, tmp_path):
    episode = _episode(np.random.default_rng(1))
    as_proto = [proto.Datum(d.model_input.to_ints(), {"target_tokens": np.asarray(d.loss_fn_inputs["target_tokens"]
                                                                                  .to_numpy())}) for d in episode]
    model = server.worker.model
    assert datum_rows.shares_prefixes(model, as_proto, 32)  # 4 turns: most of their tokens are the shared history
    assert not datum_rows.shares_prefixes(model, as_proto, None)
    assert not datum_rows.shares_prefixes(model, as_proto[:1], 32)
    unrelated = [proto.Datum(list(range(i, i + 40)), {"target_tokens": np.arange(40)}) for i in range(3)]
    assert not datum_rows.shares_prefixes(model, unrelated, 32)
    # where trees cannot run (a window the data reach), the request stays batchable
    path = str(build_random_model(tmp_path / "m", family="mistral", seed=0, sliding_window=16))
    assert not datum_rows.shares_prefixes(load_base_model(ModelConfig(path=path), path), as_proto, 32)


def test_the_planning_finds_the_root_sharing_the_longest_prefix_as_a_search_of_every_root_does():
    """prefix_trees looks at a datum's neighbours among the roots in lexicographic order only: against a reference
    that compares each datum with every root, on data of a few shared system prompts and branching histories."""
    rng = np.random.default_rng(0)
    systems = [rng.integers(3, 9, 40).tolist() for _ in range(3)]
    data = []
    for _ in range(300):
        base = list(systems[rng.integers(3)]) + rng.integers(3, 6, int(rng.integers(0, 30))).tolist()
        data.append(base + rng.integers(3, 9, int(rng.integers(1, 80))).tolist())
    trees, alone = prefix_trees(data, min_shared=32)

    def shared(a, b):
        n = min(len(a), len(b))
        return next((i for i in range(n) if a[i] != b[i]), n)

    roots, joined = [], {}
    for i in sorted(range(len(data)), key=lambda j: (-len(data[j]), j)):  # the same greedy rule, every root searched
        best = max(roots, key=lambda r: (shared(data[r], data[i]), -roots.index(r)), default=None)
        s = 0 if best is None else shared(data[best], data[i])
        if best is not None and s >= 32 and 2 * s >= len(data[i]):
            joined[i] = s
        else:
            roots.append(i)
    assert {m: s for t in trees for m, s in zip(t.members, t.shared)} == joined
    assert set(alone) | {t.root for t in trees} == set(roots)
    assert len(trees) > 3 and len(joined) > 100


def test_rlora_serve_no_shared_prefixes_runs_every_datum_whole(tiny_model_dir, tmp_path, capsys):
    from rlora.cli import main
    from rlora.serve.main import build

    episode = _episode(np.random.default_rng(2))
    as_proto = [proto.Datum(d.model_input.to_ints(), {"target_tokens": np.asarray(d.loss_fn_inputs["target_tokens"]
                                                                                  .to_numpy())}) for d in episode]
    for shared_prefixes, trees in ((True, 1), (False, 0)):
        _, served = build(tiny_model_dir, tmp_path / f"state-{shared_prefixes}", shared_prefixes=shared_prefixes)
        served.jobs.stop()
        worker = served.worker
        planned = datum_rows.passes(worker.model, as_proto, worker.min_shared_prefix)
        assert sum(shared is not None for _, shared in planned) == trees
        assert datum_rows.shares_prefixes(worker.model, as_proto, worker.min_shared_prefix) == bool(trees)
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "--no-shared-prefixes" in capsys.readouterr().out
