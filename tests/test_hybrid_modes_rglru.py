"""RecurrentGemma's RG-LRU block in both mixing modes: head-parallel and state passing (issue #43).

RecurrentGemma (a conv1d + RG-LRU recurrent block next to a sliding-window softmax layer, window 8)
built with ``attn_implementation=register(state, mixing=...)`` runs on token shards in each mode:
float64 logits and CP-summed parameter gradients equal the one-device sdpa model's and each
other's, at an odd length (37) under ring x Ulysses 2 x 2 (quick), 3 x 1 and 1 x 4 (slow).
``"auto"`` runs what the block's byte predictions favour (state passing at 37 tokens, head-parallel
at 9), bitwise that mode's logits, and the predictions are the bytes the collectives are handed.
The block alone, called with position ids that restart inside the sequence (a document reset on
some rank other than the first), is exact in both modes too, outputs and input gradients.

The model keeps float32 islands that round differently on a shard than on the whole sequence
(its RMSNorms compute in float32, and ``_rnn_scan`` accumulates in float32), so both the
one-device and the sharded models get float64 versions of them here: the norm written from its
definition, the scan as the model's own with a float64 accumulator.
"""

import math

import pytest
import torch

pytest.importorskip("transformers")

from _hf import SEQ_LEN, build, diff, each_world, modeling, on_shards, one_device, patched, token_ids  # noqa: E402

from seqpar import ParallelState, shard, shard_positions  # noqa: E402
from seqpar.integrations.transformers import register  # noqa: E402
from seqpar.integrations.transformers_mixers import install, mixing_modes  # noqa: E402
from seqpar.tools.profiling import CollectiveRecorder  # noqa: E402

FAMILY = "recurrent_gemma"
SHORT = 9  # "auto" runs head-parallel here (fewer predicted bytes); pieces shorter than the conv's halo
TOL = 1e-10  # float64
MODES = ("head_parallel", "state_passing")
RESTART = 20  # the block-level run's second document starts here


# --- float64 versions of the float32 islands (the one-device and the sharded models get them) -----


def _rms_norm_float64(self, x):
    """RecurrentGemmaRMSNorm in the input's dtype: ``x / rms(x) * (1 + weight)``."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def _float64_islands():
    """The float64 islands in the modeling file (read by the one-device forward and by the adapter
    when it installs), and one torch thread (``_hf.patched``)."""
    file = modeling(FAMILY)
    scan = file.RecurrentGemmaRglru._rnn_scan

    def rnn_scan_float64(self, hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype=torch.float64):
        return scan(self, hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype=torch.float64)

    return patched([
        (file.RecurrentGemmaRMSNorm, "forward", _rms_norm_float64),
        (file.RecurrentGemmaRglru, "_rnn_scan", rnn_scan_float64),
    ])


# --- the model, one device or sharded ---------------------------------------------------------------


def _build(attn_implementation: str):
    return build(FAMILY, attn_implementation)


def _ids(length: int):
    return token_ids(2, length, length)


def _references(lengths):
    """Per length, the one-device model's logits and loss gradients."""
    with _float64_islands():
        return {length: one_device(_build("sdpa"), _ids(length)) for length in lengths}


def _sharded(model, state: ParallelState, length: int):
    """This rank's logits and CP-summed gradients."""
    return on_shards(model, state, _ids(length))


# --- the block alone: a document reset inside the sequence --------------------------------------


def _block_call(block, x, positions):
    out, _ = block(x, positions, None, use_cache=False)
    return out


def _block_run(state: ParallelState, modes):
    """Per mode, this rank's output and input-gradient errors of the first recurrent block against
    the same block on one device, with positions restarting at ``RESTART``; and what ran."""
    x_full = torch.randn(2, SEQ_LEN, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    positions = torch.cat([torch.arange(RESTART), torch.arange(SEQ_LEN - RESTART)])[None]
    block = _build("sdpa").model.layers[0].temporal_block
    x_ref = x_full.clone().requires_grad_()
    out_ref = _block_call(block, x_ref, positions)
    weight = torch.randn(out_ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    (grad_ref,) = torch.autograd.grad((out_ref * weight).sum(), x_ref)
    out = {}
    for mode in modes:
        model = _build("sdpa")
        install(model, state, mixing=mode)
        block = model.model.layers[0].temporal_block
        x = shard(x_full, state).requires_grad_()
        y = _block_call(block, x, shard(positions, state, dim=1))
        (grad,) = torch.autograd.grad((y * shard(weight, state)).sum(), x)
        out[mode] = (
            (y - shard(out_ref, state)).abs().max().item(),
            (grad - shard(grad_ref, state)).abs().max().item(),
            {m.mode for m in mixing_modes(model).values()},
        )
    return out


def _bytes(state: ParallelState):
    """Per mode, the bytes this rank hands to the collectives in one forward of the first
    recurrent block (no gradient) and the chooser's prediction of the bytes it receives."""
    x = shard(torch.randn(2, SEQ_LEN, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(5)), state)
    positions = shard_positions(SEQ_LEN, state)[None]
    out = {}
    for mode in MODES:
        model = _build("sdpa")
        install(model, state, mixing=mode)
        block = model.model.layers[0].temporal_block
        with torch.no_grad(), CollectiveRecorder() as recorder:
            _block_call(block, x, positions)
        (ran,) = mixing_modes(model).values()
        predicted = ran.head_parallel_bytes if mode == "head_parallel" else ran.state_passing_bytes
        out[mode] = (sum(recorder.bytes.values()), predicted)
    return out


# --- the runs ---------------------------------------------------------------------------------------


def _run(worlds, references, quick: bool):
    """Per world: {mode: errors against one device}, state passing vs head-parallel, {mode: modes
    the adapted blocks ran}, and (``quick``) the "auto" runs, the block-level resets and bytes."""

    def run(state, ring, ulysses):
        modes = MODES + (("auto",) if quick else ())
        names = {m: register(state, name=f"seqpar-test-rglru-{m}-{ring}x{ulysses}", mixing=m) for m in modes}
        errors, ran, results = {}, {}, {}
        for length in (SEQ_LEN, SHORT) if quick else (SEQ_LEN,):
            local_ref = (shard(references[length][0], state), references[length][1])
            for mode in modes:
                model = _build(names[mode])
                results[length, mode] = _sharded(model, state, length)
                errors[length, mode] = diff(results[length, mode], local_ref)
                ran[length, mode] = {
                    (m.mode, m.tokens_per_rank, m.head_parallel_bytes < m.state_passing_bytes)
                    for m in mixing_modes(model).values()
                }
        between = diff(results[SEQ_LEN, "state_passing"], results[SEQ_LEN, "head_parallel"])
        extra = {}
        if quick:
            extra["auto_same"] = {
                length: {m: torch.equal(results[length, "auto"][0], results[length, m][0]) for m in MODES}
                for length in (SEQ_LEN, SHORT)
            }
            extra["block"] = _block_run(state, MODES)
            extra["bytes"] = _bytes(state)
        return errors, between, ran, extra

    with _float64_islands():
        return each_world(worlds, run)  # a rank left waiting fails


def _check(worlds, per_rank):
    for rank, results in enumerate(per_rank):
        for (ring, ulysses), (errors, between, ran, _) in zip(worlds, results):
            for (length, mode), err in errors.items():
                where = (f"{ring}x{ulysses}", rank, length, mode, err)
                assert err["logits"] < TOL and err["grad"] < TOL, where
                if mode in MODES:  # every adapted block ran the mode asked for
                    assert {m for m, _, _ in ran[length, mode]} == {mode}, (where, ran[length, mode])
            assert between["logits"] < TOL and between["grad"] < TOL, (f"{ring}x{ulysses}", rank, between)


def _check_quick(per_rank):
    for rank, results in enumerate(per_rank):
        (errors, _, ran, extra) = results[0]
        # "auto" compares the bytes at ceil(S / 4) tokens per rank: at 37 state passing moves fewer
        # (the conv halo and two [32] summaries per piece), at 9 head-parallel does.
        assert ran[SEQ_LEN, "auto"] == {("state_passing", math.ceil(SEQ_LEN / 4), False)}, (rank, ran[SEQ_LEN, "auto"])
        assert ran[SHORT, "auto"] == {("head_parallel", math.ceil(SHORT / 4), True)}, (rank, ran[SHORT, "auto"])
        assert extra["auto_same"][SEQ_LEN]["state_passing"], rank  # bitwise the mode it picked
        assert extra["auto_same"][SHORT]["head_parallel"], rank
        for mode, (out_err, grad_err, ran_block) in extra["block"].items():
            assert out_err < TOL and grad_err < TOL, (rank, mode, out_err, grad_err)
            assert ran_block == {mode}, (rank, mode, ran_block)
        # Predicted: bytes received; measured: bytes handed to the collectives. Head-parallel hands
        # each all-to-all this rank's whole shard, (N - 1) / N of which leaves it (the prediction
        # is at ceil(S / N) tokens); state passing hands the all-gathers its pieces' rows, which each
        # of the N - 1 others receives; the prediction counts two pieces per rank on a zig-zag ring,
        # where 2 x 2's Ulysses cut gives each rank one chunk: at most twice what moves. A few ints
        # of length checks ride along.
        sent, predicted = extra["bytes"]["head_parallel"]
        assert abs(predicted - sent * 3 / 4) <= 0.05 * predicted, (rank, "head_parallel", sent, predicted)
        sent, predicted = extra["bytes"]["state_passing"]
        assert sent * 3 <= predicted * 1.05 and predicted <= 2 * sent * 3, (rank, "state_passing", sent, predicted)

@pytest.mark.slow
def test_rglru_modes_exact_and_equal_2x2(pools):
    worlds = [(2, 2)]
    per_rank = pools(4).run(_run, worlds, _references((SEQ_LEN, SHORT)), True)
    _check(worlds, per_rank)
    _check_quick(per_rank)


@pytest.mark.slow
@pytest.mark.parametrize("worlds", [[(3, 1)], [(1, 4)]], ids=["3x1", "1x4"])
def test_rglru_modes_exact_and_equal_on_shards(pools, worlds):
    size = worlds[0][0] * worlds[0][1]
    per_rank = pools(size).run(_run, worlds, _references((SEQ_LEN,)), False)
    _check(worlds, per_rank)
