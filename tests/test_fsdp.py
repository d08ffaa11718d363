"""DeviceMesh <-> ParallelState and FSDP2 training with seqpar's gradient rule (gloo, CPU)."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from seqpar import ParallelState, parallel_sdpa, shard, shard_positions
from seqpar.tools.models import VideoDiT, patchify
from seqpar.training import fully_shard_cp, global_loss, sharded_mean

pytestmark = pytest.mark.slow  # long multi-rank runs: not in the quick subset


def _members(pg):
    return dist.get_process_group_ranks(pg)


def _same_layout(s, ref):
    """Sizes, ranks and group members of ``s`` equal those of ``ref``; every group of ``s`` works."""
    for axis in ("ring", "ulysses", "cp", "dp"):
        assert getattr(s, f"{axis}_size") == getattr(ref, f"{axis}_size"), axis
        assert getattr(s, f"{axis}_rank") == getattr(ref, f"{axis}_rank"), axis
        group = getattr(s, f"{axis}_group")
        assert _members(group) == _members(getattr(ref, f"{axis}_group")), axis
        assert dist.get_rank(group) == getattr(s, f"{axis}_rank"), axis
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t, group=group)
        assert t.item() == sum(_members(group)), axis
    assert _members(s.parent_group) == _members(ref.parent_group)
    assert s.cp_size == s.ring_size * s.ulysses_size and s.cp_rank == s.ring_rank * s.ulysses_size + s.ulysses_rank


def _layout_case(shape, axes, kwargs, ring, ulysses):
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=axes)
    s = ParallelState.from_device_mesh(mesh, **kwargs)
    ref = ParallelState(ring, ulysses)
    _same_layout(s, ref)
    mesh_groups = [mesh.get_group(i) for i in range(mesh.ndim)]
    assert any(g is s.cp_group or g is s.ring_group or g is s.ulysses_group for g in mesh_groups)
    # Round trip through the reverse direction: the same groups, no new ones for dp/ring/ulysses.
    back = ParallelState.from_device_mesh(ref.device_mesh("cpu", split_cp=True))
    _same_layout(back, ref)
    assert back.ring_group is ref.ring_group and back.ulysses_group is ref.ulysses_group
    assert back.dp_group is ref.dp_group
    two = ref.device_mesh("cpu")
    assert two.mesh_dim_names == ("dp", "cp") and tuple(two.shape) == (ref.dp_size, ref.cp_size)
    assert two.get_group("cp") is ref.cp_group and two.get_group("dp") is ref.dp_group
    # close() frees only what the state created: the mesh's groups keep working.
    s.close()
    assert s.cp_group is None
    for g in mesh_groups:
        t = torch.ones(1)
        dist.all_reduce(t, group=g)
        assert t.item() == g.size()
    back.close()
    ref.close()
    return repr(ParallelState.from_device_mesh(mesh, **kwargs))


@pytest.mark.parametrize(
    "world,shape,axes,kwargs,ring,ulysses",
    [
        (4, (2, 2), ("dp", "cp"), {}, 2, 1),
        (4, (1, 2, 2), ("dp", "ring", "ulysses"), {}, 2, 2),
        (4, (2, 2), ("ring", "ulysses"), {}, 2, 2),
        (4, (2, 2), ("dp", "cp"), {"ulysses": "cp"}, 1, 2),
        (4, (4,), ("cp",), {}, 4, 1),
        (4, (2, 2), ("data", "context"), {"dp": "data", "cp": "context"}, 2, 1),
        (3, (1, 3), ("dp", "cp"), {}, 3, 1),
        (3, (3,), ("cp",), {}, 3, 1),
        (3, (3,), ("cp",), {"ulysses": "cp"}, 1, 3),
    ],
)
def test_state_from_device_mesh_layout(pools, world, shape, axes, kwargs, ring, ulysses):
    reprs = pools(world).run(_layout_case, shape, axes, kwargs, ring, ulysses)
    assert f"ring {0}/{ring}" in reprs[0] and f"ulysses {0}/{ulysses}" in reprs[0]


def _submesh_case():
    # torchtitan-style: slice seqpar's axes out of a larger mesh; the state covers one slice.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    s = ParallelState.from_device_mesh(mesh["cp"])
    ref = ParallelState(2, 1, group=mesh.get_group("cp"))
    _same_layout(s, ref)
    assert s.dp_size == 1 and _members(s.parent_group) == _members(mesh.get_group("cp"))
    return _members(s.cp_group)


def test_state_from_submesh(pools):
    assert pools(4).run(_submesh_case) == [[0, 1], [0, 1], [2, 3], [2, 3]]


def _mesh_errors():
    def raises(match, fn):
        with pytest.raises(ValueError, match=match):
            fn()

    def mesh(shape, axes):
        return init_device_mesh("cpu", shape, mesh_dim_names=axes)

    raises(r"mesh must be a torch.distributed.device_mesh.DeviceMesh, got NoneType",
           lambda: ParallelState.from_device_mesh(None))
    raises(r"mesh of shape \(2, 2\) has no axis names; .*mesh_dim_names=\('dp', 'cp'\)",
           lambda: ParallelState.from_device_mesh(init_device_mesh("cpu", (2, 2))))
    raises(r"mesh axes \('cp', 'dp'\) of sizes \(2, 2\) are out of seqpar's rank layout order .*"
           r"init_device_mesh\(device_type, \(2, 2\), mesh_dim_names=\('dp', 'cp'\)\)",
           lambda: ParallelState.from_device_mesh(mesh((2, 2), ("cp", "dp"))))
    raises(r"mesh axes \('dp', 'ulysses', 'ring'\) of sizes \(1, 4, 1\) are out of .*"
           r"\(1, 1, 4\), mesh_dim_names=\('dp', 'ring', 'ulysses'\)",
           lambda: ParallelState.from_device_mesh(mesh((1, 4, 1), ("dp", "ulysses", "ring"))))
    raises(r"'tp' \(size 2\) is not one of seqpar's axes .* mesh\['dp', 'cp'\]",
           lambda: ParallelState.from_device_mesh(mesh((1, 2, 2), ("dp", "cp", "tp"))))
    raises(r"'context' \(size 2\) is not one of seqpar's axes \(dp='dp', cp='cp'",
           lambda: ParallelState.from_device_mesh(mesh((2, 2), ("dp", "context"))))
    raises(r"have a cp axis 'cp' \(size 2\) and ring/ulysses axes 'ring' \(size 2\); .*cp=None",
           lambda: ParallelState.from_device_mesh(mesh((2, 2), ("ring", "cp"))))
    raises(r"mesh axis 'cp' \(size 4\) is named for both dp and ring",
           lambda: ParallelState.from_device_mesh(mesh((4,), ("cp",)), dp="cp"))
    raises(r"ring= must be a mesh axis name \(str\) or None, got 2",
           lambda: ParallelState.from_device_mesh(mesh((4,), ("cp",)), ring=2))
    raises(r"checks must be one of", lambda: ParallelState.from_device_mesh(mesh((4,), ("cp",)), checks="sometimes"))
    # A mesh whose groups contradict its rank tensor (from_group with a transposed tensor).
    ref = ParallelState(2, 1)
    wrong = DeviceMesh.from_group([ref.dp_group, ref.cp_group], "cpu", mesh=torch.arange(4).reshape(2, 2).T,
                                  mesh_dim_names=("dp", "cp"))
    raises(r"the mesh's dp_group has ranks \[\d, \d\], but its rank tensor \[\[0, 2\], \[1, 3\]\] puts ranks",
           lambda: ParallelState.from_device_mesh(wrong))
    # fully_shard_cp: the mesh must span exactly the dp x cp ranks.
    sub = mesh((2, 2), ("dp", "cp"))["cp"]
    raises(r"the mesh holds ranks \[\d, \d\] but the state's dp x cp ranks are \[0, 1, 2, 3\] "
           r"\(dp_size=2, cp_size=2\)", lambda: fully_shard_cp(torch.nn.Linear(2, 2), ref, mesh=sub))
    raises(r"pass mesh= or device_type=, not both",
           lambda: fully_shard_cp(torch.nn.Linear(2, 2), ref, mesh=sub, device_type="cpu"))
    ref.close()
    return True


def test_bad_meshes_raise(pools):
    assert all(pools(4).run(_mesh_errors))


def test_single_process():
    model = torch.nn.Linear(2, 2)
    state = ParallelState()
    assert fully_shard_cp(model, state) is model
    with pytest.raises(ValueError, match="has no process groups"):
        state.device_mesh("cpu")


def _batch(step, replica, dtype=torch.float64):
    g = torch.Generator().manual_seed(1000 * step + replica)
    x = patchify(torch.randn(2, 2, 3, 6, 6, generator=g, dtype=dtype), (1, 2, 2))  # [2, 27, 8]
    return x, torch.rand(2, generator=g, dtype=dtype), torch.randn(x.shape, generator=g, dtype=dtype)


def _optimizer(name, params):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def _fsdp_train_case(shape, axes, dtype_name, opt_name, steps, hsdp):
    """Train under FSDP2 + seqpar; return per step (loss error, max parameter error) against a
    single-device float64 model trained on the whole global batch."""
    dtype = getattr(torch, dtype_name)
    state = ParallelState.from_device_mesh(init_device_mesh("cpu", shape, mesh_dim_names=axes))
    torch.manual_seed(0)
    model = VideoDiT(in_channels=2, patch=(1, 2, 2), grid=(3, 3, 3), dim=24, depth=2, heads=3).to(dtype)
    ref = copy.deepcopy(model).double()
    fully_shard_cp(model, state, mesh=state.device_mesh("cpu") if hsdp else None)
    assert all(type(p).__name__ == "DTensor" for p in model.parameters())
    opt, ref_opt = _optimizer(opt_name, model.parameters()), _optimizer(opt_name, ref.parameters())
    ref_params = dict(ref.named_parameters())
    errors = []
    for step in range(steps):
        batches = [_batch(step, replica) for replica in range(state.dp_size)]
        # Reference: one device, the global batch (every replica's samples), mean loss.
        x, t, y = (torch.cat(parts) for parts in zip(*batches))
        ref_loss = ((ref(x, t) - y) ** 2).mean()
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()

        x, t, y = (v.to(dtype) for v in batches[state.dp_rank])
        with parallel_sdpa(state):
            pred = model(shard(x, state), t, shard_positions(x.shape[1], state))
        share = sharded_mean((pred - shard(y, state)) ** 2, state)
        opt.zero_grad()
        share.backward()
        opt.step()
        loss_err = abs(global_loss(share, state).item() - ref_loss.item())
        param_err = max(
            (p.full_tensor().double() - ref_params[name]).abs().max().item()
            for name, p in model.named_parameters()
        )
        errors.append((loss_err, param_err))
    state.close()
    return errors


@pytest.mark.parametrize(
    "shape,axes,dtype,opt,hsdp,tol",
    [
        ((2, 2), ("dp", "cp"), "float32", "sgd", False, 1e-5),
        ((1, 2, 2), ("dp", "ring", "ulysses"), "float32", "sgd", False, 1e-5),
        ((2, 2), ("dp", "cp"), "float64", "sgd", True, 1e-12),
        ((2, 1, 2), ("dp", "ring", "ulysses"), "float64", "adamw", False, 1e-12),
    ],
    ids=["dp2-cp2-fp32-sgd", "ring2-ulysses2-fp32-sgd", "dp2-cp2-hsdp-fp64-sgd", "dp2-ulysses2-fp64-adamw"],
)
def test_fsdp2_training_matches_single_device(pools, shape, axes, dtype, opt, hsdp, tol):
    # The SGD cases catch a wrong gradient scale (FSDP2's default mean over all dp x cp ranks is
    # cp_size times too small); AdamW hardly sees a scale. AdamW runs in float64: in float32 it
    # turns the rounding of tiny gradients into parameter errors of ~lr * 1e-3, on one device too.
    per_rank = pools(4).run(_fsdp_train_case, shape, axes, dtype, opt, 3, hsdp)
    for errors in per_rank:
        assert len(errors) == 3
        for loss_err, param_err in errors:
            assert loss_err < tol and param_err < tol, (loss_err, param_err)
