"""Fine-tuning on conversations (data.format=sft): packing, answer-only loss, and the layouts.

Conversations here are synthetic (random token ids, a prompt part and an answer part), held in memory in the
shape training/data/sft.py reads from PREFIX / PREFIX.mask, and packed by its PackedConversations:
- a packed sequence's per-token losses equal each conversation's run alone (1e-5), with RoPE, with learned
  positions, with every attention option (window, sinks, soft-caps, scale, QK-norm) and with MLA, and one
  conversation's loss gives no gradient to another's tokens;
- prompt tokens count for nothing: the loss is the hand-computed masked mean, and changing a later prompt
  leaves the earlier answers' losses alone;
- tp2, pp2, pp2 x vpp2, dp2 (whose ranks hold very different answer counts), and tp2 / pp2 with selective / full
  recomputation train the one-process model (1e-5).
"""

import numpy as np
import pytest
import torch
from harness import run_distributed
from layouts import VOCAB, max_rel_diff, model_overrides, run_layouts
from model_options import MLA_OPTIONS

from training.data.sft import Conversations, PackedConversations, best_fit

SEQ = 16


class Sequences:
    """In-memory stand-in for an IndexedDataset: sequence_lengths and get(doc, offset, length)."""

    def __init__(self, arrays: list[np.ndarray]):
        self.arrays, self.sequence_lengths = arrays, np.array([len(a) for a in arrays], dtype=np.int32)

    def get(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        return self.arrays[doc][offset:None if length is None else offset + length]


def conversations(masks: list[str], seed: int = 0) -> Conversations:
    """One conversation per mask string ("0011" or "001100111": 0 a prompt token, 1 an answer token), random ids."""
    rng = np.random.default_rng(seed)
    ids = [rng.integers(0, VOCAB, len(m)) for m in masks]
    return Conversations([(Sequences(ids), Sequences([np.array([int(c) for c in m], np.uint8) for m in masks]),
                           range(len(ids)))])


def turns(n: int, p: int) -> str:
    """n tokens, the first p the prompt."""
    return "0" * p + "1" * (n - p)


def test_best_fit_places_every_item_once_within_capacity():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 17, 500)
    bins = best_fit(lengths, 16)
    placed = sorted(i for b in bins for i in b)
    assert placed == list(range(500))
    assert max(sum(lengths[b]) for b in bins) <= 16
    # best fit: no two bins could be merged (else it opened a bin it did not need)
    loads = sorted(sum(lengths[b]) for b in bins)
    assert loads[0] + loads[1] > 16, loads[:4]
    assert len(bins) <= int(np.ceil(lengths.sum() / 16 * 1.1)), (len(bins), lengths.sum() / 16)


@pytest.mark.fast
def test_packing_is_seeded_complete_and_counts_the_overlong():
    data = conversations([turns(*c) for c in ((5, 2), (9, 4), (30, 3), (1, 0), (18, 5), (12, 6), (3, 1))])
    packed = PackedConversations(data, SEQ, seed=7, num_samples=6, eod=0, overlong="truncate")
    again = PackedConversations(data, SEQ, seed=7, num_samples=6, eod=0, overlong="truncate")
    assert [s.tolist() for s in packed.samples] == [s.tolist() for s in again.samples]
    # every conversation of 2+ tokens once an epoch (the 1-token one has no target), whole epochs
    placed = sorted(c for s in packed.samples for c in s.tolist())
    assert packed.epochs >= 2 and placed == sorted([0, 1, 2, 4, 5, 6] * packed.epochs)
    assert (packed.truncated, packed.dropped) == (2, 1)  # 30 and 18 tokens fill more than 16 positions
    dropped = PackedConversations(data, SEQ, seed=7, num_samples=2, eod=0, overlong="drop")
    assert dropped.dropped == 3 and 2 not in np.concatenate(dropped.samples)
    # a sequence that packs several conversations: each one's span, in order, as it would be alone
    index = max(range(len(packed)), key=lambda i: len(packed.samples[i]))
    held = packed.samples[index].tolist()
    assert len(held) >= 2, [s.tolist() for s in packed.samples]
    sample, at = packed[index], 0
    for segment, conversation in enumerate(held, 1):
        n = min(int(data.lengths[conversation]), SEQ + 1) - 1  # positions it fills: cut to SEQ + 1 tokens
        ids, mask = data.get(conversation, n + 1)
        span = slice(at, at + n)
        assert sample["segment_ids"][span].tolist() == [segment] * n, (segment, sample["segment_ids"])
        assert sample["position_ids"][span].tolist() == list(range(n)), (segment, sample["position_ids"])
        assert sample["tokens"][span].tolist() == ids[:-1].tolist() and sample["labels"][span].tolist() == \
            ids[1:].tolist()
        assert sample["loss_mask"][span].tolist() == mask[1:].tolist()
        at += n
    assert (sample["segment_ids"][at:] == 0).all() and sample["loss_mask"][at:].sum() == 0  # padding


def _model_checks(model_options: list[list[str]]) -> list[dict]:
    """One process: for each model, a packed sample against its conversations alone, the cross gradients, and the
    engine's loss against a hand-computed masked mean."""
    import torch.nn.functional as F

    from models.shape import ModelShape
    from training.config.compose import compose
    from training.config.validate import validate
    from training.data.streams import micro_batch_streams
    from training.engine.build import build
    from training.engine.losses import global_loss
    from training.engine.step import run_schedule
    from training.parallel import dist as D
    from training.parallel.wrap import unwrap

    out = []
    # 7 + 4 + 3 = 14 positions: one sequence and padding; the first conversation has two turns
    data = conversations(["00110011", turns(5, 2), turns(4, 1)], seed=1)
    packed = PackedConversations(data, SEQ, seed=0, num_samples=1, eod=0)
    sample = packed[0]
    assert len(packed.samples[0]) == 3
    for options in model_options:
        cfg = compose(model_overrides(*options, "train.global_batch_size=1", "train.micro_batch_size=1"))
        layout = validate(cfg, world_size=1)
        info = D.init(**{**D.layout_of(cfg), "timeout_minutes": 2})
        state = build(cfg, ModelShape.of(cfg.model, VOCAB), info.device)
        gpt = unwrap(state.model[0])
        gpt.eval()  # no dropout: exact comparisons
        captured = {}
        hook = gpt.embedding.register_forward_hook(lambda m, i, o: captured.setdefault("x", o).retain_grad())
        batch = {k: v[None] for k, v in sample.items()}  # [1, s]
        losses = gpt(batch["tokens"], batch["labels"], position_ids=batch["position_ids"],
                     segment_ids=batch["segment_ids"])[0]  # [s]
        alone, at = [], 0
        for conversation in packed.samples[0].tolist():
            n = int(packed.positions[conversation])
            ids, _ = data.get(conversation, n + 1)
            ids = torch.from_numpy(ids.astype(np.int64))[None]
            alone.append((losses[at:at + n].detach(), gpt(ids[:, :-1], ids[:, 1:])[0].detach()))
            at += n
        first = int(packed.positions[packed.samples[0][0]])
        losses[:first].sum().backward()  # the first conversation's loss alone
        grad = captured["x"].grad[:, 0].abs().sum(-1)  # [s] per position
        hook.remove()
        with torch.no_grad():
            logits = gpt(batch["tokens"], position_ids=batch["position_ids"], segment_ids=batch["segment_ids"])
        by_hand = F.cross_entropy(logits[0, :, :VOCAB].float(), batch["labels"][0], reduction="none")  # [s]
        by_hand = (by_hand * batch["loss_mask"][0]).sum() / batch["loss_mask"][0].sum()
        engine = global_loss(run_schedule(state, micro_batch_streams(1, [sample], 0, 1, True), layout, cfg, True),
                             info.device).item()
        # later prompt tokens changed: the input at the two-turn conversation's second prompt (its tokens 4, 5), and
        # another conversation's first token; the losses before them and of the other conversations stay
        changed = {k: v.clone() for k, v in batch.items()}
        start = int((changed["segment_ids"][0] == segment_of(packed, 0)).nonzero()[0])
        other = int((changed["segment_ids"][0] == segment_of(packed, 1)).nonzero()[0])
        for at in (start + 4, start + 5, other):
            changed["tokens"][0, at] = (changed["tokens"][0, at] + 1) % VOCAB
        with torch.no_grad():
            after = gpt(changed["tokens"], changed["labels"], position_ids=changed["position_ids"],
                        segment_ids=changed["segment_ids"])[0]
        out.append({"alone": alone, "grad": grad, "first": first, "by_hand": by_hand.item(), "engine": engine,
                    "losses": losses.detach(), "after": after, "start": start, "other": other,
                    "segments": batch["segment_ids"][0], "mask": batch["loss_mask"][0]})
        D.reset_model_parallel()
    D.teardown()
    return out


def segment_of(packed, conversation: int) -> int:
    """The segment id (1, 2, ...) conversation `conversation` has in the first packed sequence."""
    return packed.samples[0].tolist().index(conversation) + 1


GPT2 = ["model.position_embedding=learned", "model.normalization=LayerNorm", "model.activation=gelu",
        "model.num_query_groups=4", "model.tie_embeddings=false"]
# every attention option (a window of 3 < the 7-token conversation on the sliding layers, sinks, soft-caps, the
# scale, QK-norm) and multi-latent attention (its own block: the packed mask and per-token positions reach it too)
ATTENTION = ["model.sliding_window=3", "model.layer_types=[sliding,full,sliding,full]", "model.attention_sinks=true",
             "model.attn_logit_softcap=3.0", "model.final_logit_softcap=5.0", "model.query_pre_attn_scalar=8",
             "model.qk_norm=true"]
PACKED_MODELS = {"rope": [], "learned": GPT2, "options": ATTENTION, "mla": MLA_OPTIONS}


@pytest.mark.slow
def test_packed_conversations_compute_what_each_computes_alone():
    (results,) = run_distributed(_model_checks, 1, (list(PACKED_MODELS.values()),), timeout=600)
    for name, result in zip(PACKED_MODELS, results):
        for packed, alone in result["alone"]:
            assert max_rel_diff(packed, alone) < 1e-5, (name, packed, alone)
        grad, first = result["grad"], result["first"]
        assert (grad[:first] > 0).all(), "the first conversation's own tokens get its gradient"
        assert (grad[first:] == 0).all(), f"another conversation's tokens got gradient: {grad[first:]}"
        assert result["engine"] == pytest.approx(result["by_hand"], rel=1e-6)
        before, after, start, segments = result["losses"], result["after"], result["start"], result["segments"]
        unchanged = torch.ones_like(segments, dtype=torch.bool)
        unchanged[start + 4:start + 7] = False  # the two-turn conversation (7 positions) from its second prompt on
        unchanged[segments == segments[result["other"]]] = False
        assert result["mask"][start:start + 4].tolist() == [0, 1, 1, 0]  # positions predict tokens 1-4: answer 1
        assert torch.equal(before[unchanged], after[unchanged]), "a later prompt changed an earlier or another loss"
        assert not torch.equal(before[~unchanged], after[~unchanged])


# ---- the layouts: tp2, pp2, dp2 against one process, from the same seed, 3 steps + the last gradients --------
def _layout_batch() -> list[dict]:
    """4 packed sequences; in micro-batches of 1, DP rank 0 of 2 reads samples 0 and 2 (few answer tokens), rank 1
    samples 1 and 3 (many); one process reads micro-batches (0, 1) and (2, 3): a mean per micro-batch or per rank
    instead of the global batch's would differ."""
    few = [turns(*c) for c in ((6, 5), (6, 4), (5, 4), (4, 3), (7, 5))]
    many = [turns(*c) for c in ((9, 1), (8, 1), (8, 2), (7, 1), (9, 2))]
    few, many = (PackedConversations(conversations(c, seed=2), SEQ, 0, 2, 0) for c in (few, many))
    batch = [few[0], many[0], few[1], many[1]]
    counts = [float(s["loss_mask"].sum()) for s in batch]
    assert 2 * (counts[0] + counts[2]) < counts[1] + counts[3], counts  # the ranks' answer counts: uneven
    return batch


STEPS = ["optim.lr=1e-2", "optim.warmup_iters=0", "optim.clip_grad=0.0", "optim.adam_eps=1e-4",
         "data.format=sft", "data.paths=[unused]"]  # the config's rules see an SFT run; the batch is given
LAYOUTS = {"tp2": ["parallel.tp=2", "parallel.sp=true"], "pp2": ["parallel.pp=2"],
           "dp2": ["train.micro_batch_size=1"],
           # virtual stages in the middle of the pipeline take the segments and positions too
           "pp2-vpp2": ["parallel.pp=2", "parallel.vpp=2", "train.micro_batch_size=1"],
           # recomputation replays attention with the packed mask
           "tp2-selective": ["parallel.tp=2", "model.recompute=selective"],
           "pp2-full": ["parallel.pp=2", "model.recompute=full"]}


@pytest.mark.slow
def test_sft_layouts_train_the_single_process_model():
    batch = _layout_batch()
    (ref,) = run_layouts([(model_overrides(*STEPS), None, 4, False)], 1, batch)
    outs = run_layouts([(model_overrides(*STEPS, *o), None, 4, False) for o in LAYOUTS.values()], 2, batch)
    for name, out in zip(LAYOUTS, outs):
        for result in (ref, out):
            if isinstance(result, Exception):
                raise result
        assert out["losses"] == pytest.approx(ref["losses"], rel=1e-5), name
        bad = {n: d for n, w in ref["params"].items() if (d := max_rel_diff(out["params"][n], w)) > 3e-5}
        assert not bad, f"{name}: weights after the updates differ: {bad}"
        bad = {n: d for n, g in ref["grads"].items() if (d := max_rel_diff(out["grads"][n], g)) > 3e-5}
        assert not bad, f"{name}: gradients of the last step differ: {bad}"
