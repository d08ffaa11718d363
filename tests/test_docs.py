"""Every ```python block of docs/*.md and README.md runs.

Blocks are the code every rank runs (as under ``torchrun``): each runs in a ``DistPool`` of as many
gloo ranks as it needs (one by default), where ``torch.distributed`` is already initialised, so a
block's own ``dist.init_process_group(...)`` / ``destroy_process_group()`` are no-ops there.
Fragments -- blocks that use names an earlier paragraph introduced (``model``, ``x_full``, ...) --
are completed by hidden setup code from ``FRAGMENTS`` below, keyed by the page and a line of the
block, not skipped. A block that imports an optional package (transformers, diffusers, timm,
flash-attn), or whose page marks it with ``<!-- docs-test: requires=diffusers -->`` on the line
before the fence, is skipped -- with the reason shown by ``pytest -rs`` -- only when the package
is missing or cannot be imported here. timm is imported as ``tests/test_timm.py`` imports it: behind
a stand-in for torchvision when no working torchvision is importable
(``seqpar.tools.torchvision_stub``).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
# Import names of optional packages, and seqpar modules that need one.
OPTIONAL = {
    "transformers": "transformers", "diffusers": "diffusers", "timm": "timm", "flash_attn": "flash_attn",
    "seqpar.integrations.transformers": "transformers", "seqpar.integrations.diffusers": "diffusers",
    "seqpar.integrations.timm": "timm",
}
_MARKER = re.compile(r"<!--\s*docs-test:\s*requires=([\w.,\s]+?)\s*-->")


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence
    code: str
    marked: tuple[str, ...]  # packages the page marks the block as requiring

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def _blocks() -> list[Block]:
    out = []
    for path in PAGES:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip() == "```python":
                j = i + 1
                while lines[j].strip() != "```":
                    j += 1
                before = next((ln for ln in reversed(lines[:i]) if ln.strip()), "")
                marker = _MARKER.search(before)
                marked = tuple(p.strip() for p in marker.group(1).split(",")) if marker else ()
                out.append(Block(str(path.relative_to(ROOT)), i + 1, "\n".join(lines[i + 1:j]) + "\n", marked))
                i = j
            i += 1
    return out


# --- hidden setup of fragments ---------------------------------------------------------------
# (page, a line of the block) -> ranks, setup code run first, packages required.

_DIT = """
import torch
torch.nn.Module.cuda = lambda self, *args, **kwargs: self    # the page's GPU code, on CPU ranks
video = torch.randn(1, 4, 13, 18, 30)                         # [B, C, T, H, W] for grid (13, 9, 15)
t = torch.rand(1)
target = torch.randn(1, 13 * 9 * 15, 16)
"""
_SDPA_LAYERS = """
import torch
import torch.nn.functional as F
import seqpar
state = seqpar.ParallelState(ring_size=2)
w = torch.nn.Linear(16, 48)
def _heads(t):
    return t.view(*t.shape[:2], 2, 8).transpose(1, 2)
def self_attn(x):
    q, k, v = w(x).chunk(3, -1)
    return F.scaled_dot_product_attention(_heads(q), _heads(k), _heads(v)).transpose(1, 2).flatten(2)
def cross_attn(x, context):
    q, k, v = w(x).chunk(3, -1)[0], w(context).chunk(3, -1)[1], w(context).chunk(3, -1)[2]
    return F.scaled_dot_product_attention(_heads(q), _heads(k), _heads(v)).transpose(1, 2).flatten(2)
x = seqpar.shard(torch.randn(1, 27, 16), state)
text_tokens = torch.randn(1, 5, 16)
image_tokens = torch.randn(1, 27, 16)
joint_block = self_attn
def block(x, c):
    return self_attn(x) + c
c = torch.randn(1, 1, 16)
"""
_FLUX = """
import torch
from diffusers import FluxTransformer2DModel
torch.manual_seed(0)
_tiny = FluxTransformer2DModel(
    patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=8,
    num_attention_heads=4, joint_attention_dim=12, pooled_projection_dim=6, axes_dims_rope=(2, 2, 4),
)
g = torch.Generator().manual_seed(1)
latents, text, pooled = torch.randn(2, 15, 8, generator=g), torch.randn(2, 7, 12, generator=g), torch.randn(2, 6, generator=g)
t, img_ids, txt_ids = torch.tensor([0.3, 0.7]), torch.randn(15, 3, generator=g), torch.randn(7, 3, generator=g)
inputs = dict(hidden_states=latents, encoder_hidden_states=text, pooled_projections=pooled, timestep=t,
              img_ids=img_ids, txt_ids=txt_ids)
"""
# The page loads a hub checkpoint onto CUDA: here, the tiny model above on CPU ranks.
_FLUX_PRETRAINED = _FLUX + """
_tiny.to = lambda *args, **kwargs: _tiny
FluxTransformer2DModel.from_pretrained = classmethod(lambda cls, *args, **kwargs: _tiny)
"""
_FLUX_RESTORE = "del FluxTransformer2DModel.from_pretrained  # ModelMixin's again\n"
_FLUX_TRAIN = _FLUX + """
import torch.nn.functional as F
import seqpar
from seqpar.integrations.diffusers import parallelize
state = seqpar.ParallelState(ring_size=2)
model = parallelize(_tiny, state)
target = torch.randn(2, 15, 8)
"""
_COMPILED = """
import torch
import torch.nn.functional as F
import seqpar
torch.nn.Module.cuda = lambda self, *args, **kwargs: self    # the page's GPU code, on CPU ranks
class MyTransformer(torch.nn.Module):
    def __init__(self, state):
        super().__init__()
        self.state, self.qkv = state, torch.nn.Linear(16, 48)
    def forward(self, x):
        q, k, v = self.qkv(x).view(*x.shape[:2], 3, 2, 8).unbind(2)
        return seqpar.attention(q, k, v, self.state, causal=True).flatten(2)
class _ViT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)
    def forward(self, x):
        q, k, v = self.qkv(x).view(*x.shape[:2], 3, 2, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
torch.manual_seed(0)
tokens = patches = torch.randn(1, 37, 16)
vit = _ViT()
_compile = torch.compile
def _aot_eager(model=None, **kwargs):    # inductor, the default, takes minutes on 2 shared CPU cores
    return _compile(model, **{"backend": "aot_eager", **kwargs})
torch.compile = _aot_eager
"""
_README = """
import torch
S = 64
x_full = torch.randn(1, S, 32)
def proj(x):
    return x.view(1, -1, 4, 8), x[..., :16].reshape(1, -1, 2, 8), x[..., 16:].reshape(1, -1, 2, 8)
"""
# Every block that needs timm runs after this, in its worker: timm imports torchvision at import time.
_TIMM = """
from seqpar.tools.torchvision_stub import import_timm
import_timm(stand_in=True)
"""
# The page's model is ViT-L/14 at 1036 px (300M parameters, 5,476 patches); the block runs the same
# architecture, randomly initialised, at a size a CPU test affords (5 x 5 = 25 patches, one block).
_TIMM_CREATE = """
import torch
import timm
_create_model = timm.create_model
def _small(name, **kwargs):
    return _create_model(name, **{**kwargs, "img_size": 70, "depth": 1, "embed_dim": 64, "num_heads": 4})
timm.create_model = _small
images = torch.randn(2, 3, 70, 70, generator=torch.Generator().manual_seed(0))
"""
_TORCHRUN_MODEL = """
import os
import tempfile
import torch
import torch.distributed as dist
import seqpar
from seqpar.tools.models import tiny_llama_config
from transformers import LlamaForCausalLM
path = os.path.join(tempfile.gettempdir(), "seqpar-docs-tiny-llama")   # every rank sees it
if dist.get_rank() == 0:
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config(vocab_size=97)).save_pretrained(path)
dist.barrier()
"""
_TORCHRUN_STEP = """
import torch
import seqpar
from seqpar.integrations.transformers import register
from seqpar.tools.models import tiny_llama_config
from transformers import LlamaForCausalLM
state = seqpar.ParallelState(ring_size=2)
torch.manual_seed(0)
model = LlamaForCausalLM._from_config(tiny_llama_config(vocab_size=97), attn_implementation=register(state))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
S = 45
input_ids = torch.randint(0, 97, (2, S), generator=torch.Generator().manual_seed(0))
doc_lens = [20, 25]
device = torch.device("cpu")
"""

# The framework recipes of docs/howto-trainers.md are programs for torchrun, which sets RANK,
# WORLD_SIZE and LOCAL_RANK; accelerate and Lightning read them. The pool's ranks get them for the
# block only, and accelerate's process-wide singletons are reset around it (and DeepSpeed's cached
# clone of the world group, which the pool destroyed after an earlier block).
_TRAINERS_ENV = """
import os
import torch.distributed as _dist
_saved_env = dict(os.environ)
os.environ.update(RANK=str(_dist.get_rank()), WORLD_SIZE=str(_dist.get_world_size()), LOCAL_RANK=str(_dist.get_rank()),
                  NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29512", OMP_NUM_THREADS="1")
try:
    from accelerate.state import AcceleratorState as _AcceleratorState
    _AcceleratorState._reset_state(reset_partial_state=True)
except ImportError:
    _AcceleratorState = None
"""
_TRAINERS_RESTORE = """
if _AcceleratorState is not None:
    _AcceleratorState._reset_state(reset_partial_state=True)
os.environ.clear()
os.environ.update(_saved_env)
"""

FRAGMENTS: dict[tuple[str, str], dict] = {
    ("README.md", "x = seqpar.shard(x_full, state)"): dict(ranks=8, setup=_README),
    ("docs/getting-started.md", "x = seqpar.shard(x_full, state)"): dict(ranks=4, setup=_README),
    ("docs/howto-dit.md", "model = wrap_ddp(VideoDiT("): dict(ranks=4, setup=_DIT),
    ("docs/howto-dit.md", "x = x + cross_attn(x, text_tokens)"): dict(ranks=2, setup=_SDPA_LAYERS),
    ("docs/howto-dit.md", "x = joint_block(x)"): dict(ranks=2, setup=_SDPA_LAYERS),
    ("docs/howto-dit.md", "out = checkpoint(block, x, c"): dict(ranks=2, setup=_SDPA_LAYERS),
    ("docs/howto-torchrun.md", 'dist.init_process_group("nccl")'): dict(ranks=8),
    ("docs/howto-torchrun.md", "from_pretrained(path"): dict(ranks=2, setup=_TORCHRUN_MODEL + "state = seqpar.ParallelState(ring_size=2)\n"),
    ("docs/howto-torchrun.md", "labels = shift_labels(input_ids"): dict(ranks=2, setup=_TORCHRUN_STEP),
    ("docs/howto-torchrun.md", "model = wrap_ddp(model, state)"): dict(
        ranks=2, setup=_TORCHRUN_STEP + "from seqpar.training import *\nids = seqpar.shard(input_ids, state)\n"
        "lab = seqpar.shard(shift_labels(input_ids), state)\npos = seqpar.shard_positions(S, state)[None]\n"),
    ("docs/compile.md", "model = MyTransformer(state)"): dict(
        ranks=4, setup=_COMPILED, teardown="torch.compile = _compile\n"),
    ("docs/compile.md", "compiled = torch.compile(vit"): dict(
        ranks=2, setup=_COMPILED + "state = seqpar.ParallelState(ring_size=2)\n", teardown="torch.compile = _compile\n"),
    ("docs/howto-trainers.md", "trainer = SeqparTrainer("): dict(
        ranks=2, setup=_TRAINERS_ENV, teardown=_TRAINERS_RESTORE),
    ("docs/howto-trainers.md", "accelerator = Accelerator(cpu=True)"): dict(
        ranks=2, setup=_TRAINERS_ENV, teardown=_TRAINERS_RESTORE),
    ("docs/howto-trainers.md", "trainer.fit(CausalLM(state))"): dict(
        ranks=2, setup=_TRAINERS_ENV, teardown=_TRAINERS_RESTORE),
    ("docs/howto-trainers.md", "engine, _, _, _ = deepspeed.initialize("): dict(
        ranks=2, setup=_TRAINERS_ENV + "import deepspeed.utils.groups\ndeepspeed.utils.groups._WORLD_GROUP = None\n",
        teardown=_TRAINERS_RESTORE),
    ("docs/hybrid-models.md", "rec = GatedDeltaRule(use_qk_l2norm=True"): dict(ranks=2, setup="""
import types
import torch
import seqpar
state = seqpar.ParallelState(ring_size=2)
S = 11
layer = types.SimpleNamespace(A_log=torch.zeros(2), dt_bias=torch.zeros(2))
_g = torch.Generator().manual_seed(0)
q, k, v = (seqpar.shard(torch.randn(1, S, 2, 4, generator=_g), state) for _ in range(3))
a, beta = seqpar.shard(torch.randn(1, S, 2, generator=_g), state), seqpar.shard(torch.rand(1, S, 2, generator=_g), state)
"""),
    ("docs/planner.md", "cost = calibrate(seqpar.ParallelState(ring_size=1, ulysses_size=2)"): dict(ranks=2),
    ("docs/howto-diffusers.md", "model = parallelize(model, state)"): dict(
        ranks=4, setup=_FLUX_PRETRAINED, teardown=_FLUX_RESTORE),
    ("docs/howto-diffusers.md", "SD3_PLAN = {"): dict(
        requires=("diffusers",),
        setup="from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput\n"),
    ("docs/howto-diffusers.md", "out = model(**inputs).sample"): dict(ranks=2, setup=_FLUX_TRAIN, requires=("diffusers",)),
    ("docs/howto-diffusers.md", "pipe = tiny_flux_pipeline()"): dict(ranks=2),
    ("docs/howto-timm.md", '"vit_large_patch14_reg4_dinov2"'): dict(
        ranks=4, setup=_TIMM_CREATE, teardown="timm.create_model = _create_model\n"),
    ("docs/howto-timm.md", "loss = F.cross_entropy(model(images), labels)"): dict(
        ranks=2, requires=("timm",), setup=_TIMM_CREATE + """
import torch.nn.functional as F
import seqpar
from seqpar.integrations.timm import parallelize
state = seqpar.ParallelState(ring_size=2)
model = parallelize(timm.create_model("vit_large_patch14_reg4_dinov2", num_classes=5), state)
labels = torch.tensor([1, 4])
""", teardown="timm.create_model = _create_model\n"),
}
# Pages whose blocks all run on this many ranks unless FRAGMENTS says otherwise.
PAGE_RANKS = {"docs/conventions.md": 2, "docs/troubleshooting.md": 2, "docs/recipes.md": 2}

BLOCKS = _blocks()


def _settings(block: Block) -> dict:
    found = [v for (page, key), v in FRAGMENTS.items() if page == block.page and key in block.code]
    assert len(found) <= 1, f"{block.id}: several FRAGMENTS entries match"
    settings = dict(ranks=PAGE_RANKS.get(block.page, 1), setup="", teardown="", requires=())
    settings.update(found[0] if found else {})
    return settings


def _imports(code: str) -> set[str]:
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def _required(block: Block, settings: dict) -> list[str]:
    packages = set(block.marked) | set(settings["requires"])
    for name in _imports(block.code):
        for prefix, package in OPTIONAL.items():
            if name == prefix or name.startswith(prefix + "."):
                packages.add(package)
    return sorted(packages)


@contextlib.contextmanager
def _as_under_torchrun():
    """The pool already holds the process group: a block's init / destroy become no-ops."""
    import torch.distributed as dist

    init, destroy = dist.init_process_group, dist.destroy_process_group

    def init_process_group(*args, **kwargs):
        assert dist.is_initialized()

    dist.init_process_group = init_process_group
    dist.destroy_process_group = lambda *args, **kwargs: None
    try:
        yield
    finally:
        dist.init_process_group, dist.destroy_process_group = init, destroy


def _run_block(where: str, setup: str, code: str, teardown: str) -> bool:
    """Run one block on this rank, after its setup, in a fresh namespace."""
    import torch

    namespace: dict = {"__name__": "__docs__"}
    state = torch.random.get_rng_state()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    cuda = torch.nn.Module.cuda
    try:
        with _as_under_torchrun():
            exec(compile(setup, f"{where} (setup)", "exec"), namespace)
            try:
                exec(compile(code, where, "exec"), namespace)
            finally:
                exec(compile(teardown, f"{where} (teardown)", "exec"), namespace)
    finally:
        torch.random.set_rng_state(state)
        torch.nn.Module.cuda = cuda
        assert torch.nn.functional.scaled_dot_product_attention is sdpa, f"{where} left SDPA patched"
    return True


def _unusable(package: str) -> str | None:
    """Why ``package`` cannot be used here, or ``None``."""
    if importlib.util.find_spec(package) is None:
        return f"needs {package}, which is not installed"
    try:
        if package == "timm":
            exec(_TIMM, {})  # as the block's worker will import it
        else:
            importlib.import_module(package)
    except Exception as e:  # noqa: BLE001 - installed but broken here (timm without torchvision)
        return f"needs {package}, which is installed but does not import here ({type(e).__name__}: {e})"
    return None


@pytest.mark.slow  # ~70 programs, many importing a framework: the full suite runs them, the quick subset not
@pytest.mark.parametrize("block", [pytest.param(b, id=b.id) for b in BLOCKS])
def test_block_runs(block, pools):
    settings = _settings(block)
    required = _required(block, settings)
    reasons = [r for r in map(_unusable, required) if r]
    if reasons:
        pytest.skip("; ".join(reasons))
    # Code lines, not the fence: a traceback then points at the page's own line numbers.
    code = "\n" * block.line + block.code
    setup = (_TIMM if "timm" in required else "") + settings["setup"]
    pool = pools(settings["ranks"])
    assert all(pool.run(_run_block, block.page, setup, code, settings["teardown"]))


def test_every_fragment_entry_matches_a_block():
    """A FRAGMENTS entry whose block was edited away would silently stop completing it."""
    for page, key in FRAGMENTS:
        assert any(b.page == page and key in b.code for b in BLOCKS), f"no block of {page} contains {key!r}"


def test_docs_have_python_blocks():
    pages = {b.page for b in BLOCKS}
    for page in ("README.md", "docs/conventions.md", "docs/recipes.md", "docs/planner.md"):
        assert page in pages, page


# Pages whose blocks are complete programs (every rank runs them as they are): a block that builds a
# multi-rank ParallelState must initialise the process group itself, as it would have to under
# python -m torch.distributed.run (here the pool's is already up and the call is a no-op).
COMPLETE_PAGES = ("docs/recipes.md", "docs/planner.md", "docs/howto-fsdp.md", "docs/howto-trainers.md")


def test_complete_snippets_initialise_the_process_group():
    multi_rank = re.compile(r"^[^#\n]*ParallelState\((ring_size|ulysses_size)=", re.MULTILINE)
    checked = [b for b in BLOCKS if b.page in COMPLETE_PAGES and multi_rank.search(b.code)]
    assert checked
    for b in checked:
        assert "init_process_group(" in b.code, f"{b.id}: builds a ParallelState without init_process_group"

