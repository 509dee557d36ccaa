"""LoopFormer (Jeddi et al., "Elastic-Depth Looped Transformers for Latent Reasoning via Shortcut Modulation"):
a nanoGPT decoder whose shared stack is modulated, loop by loop, by the position on a step schedule.

A schedule is R positive step sizes dt_0..dt_{R-1} (one loop each; uniform dt_r = 1/R unless given, any
positive values are accepted - they need not sum to 1). Loop r sits at time tau_r = dt_0 + ... + dt_{r-1}
(tau_0 = 0) and is conditioned on

    c_r = TE(tau_r) + DE(dt_r),      TE, DE = Linear -> SiLU -> Linear over [cos(s w_k), sin(s w_k)]_{k<128},
                                     w_k = 10000^(-k/128)   (256-dim frequency embedding, hard-coded upstream)

the same vector for every token and every block of that loop. One block (upstream ``LoopFormerBlock``)::

    g_a, g_m, s_a, s_m = W SiLU(c_r) + b                     # adaLN_modulation, chunked in this order
    x = x + g_a * attn(rms(x) * (1 + s_a))                   # rms: weightless RMSNorm, eps = finfo eps
    x = x + g_m * mlp(rms(x) * (1 + s_m))                    # mlp: c_fc -> exact GELU -> c_proj

(adaLN gates and scales only; there is no shift term). The model is x_0 = wte[ids] + wpe[pos], R passes of
the shared stack, and logits = wte . norm_f(x_R) (head tied to ``wte``). The loop state is the raw residual
x_r after the last block of loop r; ``norm_f`` is applied only by :meth:`LoopFormerLM.head`.

Upstream-faithful details: tau is accumulated step by step in the activation dtype (``tau + dt``), and the
frequency embedding is computed in fp32 and cast to the embedder's weight dtype. ``dropout`` is stored but not
applied (LoopQ runs and calibrates the model with dropout off, as upstream ``eval()`` does).

The published config has no loop count (upstream's default schedule is ``[1/8] * 8``); LoopQ reads the default
number of loops from the config key ``loopq_default_loops`` (8 when absent) and writes it back on save.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from loopq.models.base import LinearGroup, LoopLM, LoopLMError, RMSNorm, attention, rms_norm
from loopq.models.kv_cache import DecodeStep

#: size of the sinusoidal time embedding (``TimestepEmbedder.frequency_embedding_size``, fixed upstream)
FREQUENCY_EMBEDDING_SIZE = 256
MAX_PERIOD = 10000.0
#: prefix of the published weights (the Hugging Face wrapper ``LoopFormerGPTForCausalLM.gpt``)
NATIVE_PREFIX = "gpt."


@dataclass
class LoopFormerConfig:
    """The upstream ``GPTConfig`` fields plus LoopQ's default loop count (other keys are kept verbatim)."""

    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 3
    n_head: int = 32
    n_embd: int = 2048
    dropout: float = 0.0
    bias: bool = False
    intermediate_dim: int = 5120
    loopq_default_loops: int = 8
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "intermediate_dim"):
            _require_positive_int(name, getattr(self, name))
        _require_positive_int("loopq_default_loops", self.loopq_default_loops)
        if self.n_embd % self.n_head:
            raise LoopLMError(f"config.json: n_embd={self.n_embd} must be a multiple of n_head={self.n_head}")
        if not isinstance(self.bias, bool):
            raise LoopLMError(f"config.json: bias must be true or false, got {self.bias!r}")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise LoopLMError(f"config.json: dropout must be a number in [0, 1), got {self.dropout!r}")


def _require_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise LoopLMError(f"config.json: {name} must be an integer >= 1, got {value!r}")


def step_schedule(steps: Sequence[float] | Tensor | None, num_loops: int | None) -> list[float]:
    """The per-loop step sizes: ``steps`` validated, or uniform ``1/num_loops`` when ``steps`` is None."""
    if steps is None:
        if num_loops is None:
            raise LoopLMError("pass num_loops or steps")
        return [1.0 / num_loops] * num_loops
    if isinstance(steps, Tensor) and steps.dim() != 1:
        raise LoopLMError(f"steps must be a 1-D sequence of step sizes, got a tensor of shape {tuple(steps.shape)}")
    values = steps.tolist() if isinstance(steps, Tensor) else list(steps)
    if not values:
        raise LoopLMError("steps is empty; pass one positive step size per loop")
    for dt in values:
        if not isinstance(dt, (int, float)) or isinstance(dt, bool) or not math.isfinite(dt) or dt <= 0:
            raise LoopLMError(f"steps must be finite positive numbers, got {values!r}")
    if num_loops is not None and num_loops != len(values):
        raise LoopLMError(
            f"num_loops={num_loops} conflicts with steps of length {len(values)} (len(steps) is the loop count); "
            "pass only one of them"
        )
    return [float(dt) for dt in values]


def timestep_embedding(s: Tensor, dim: int = FREQUENCY_EMBEDDING_SIZE) -> Tensor:
    """Sinusoidal embedding ``[cos(s w), sin(s w)]`` of ``s`` ``[B]`` in fp32, ``w_k = MAX_PERIOD^(-k/half)``."""
    half = dim // 2
    exponent = torch.arange(half, dtype=torch.float32, device=s.device) / half
    freqs = torch.exp(-math.log(MAX_PERIOD) * exponent)
    args = s.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class TimestepEmbedder(nn.Module):
    """MLP over the frequency embedding of a scalar per batch row (upstream ``TimestepEmbedder``)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(FREQUENCY_EMBEDDING_SIZE, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, s: Tensor) -> Tensor:
        return self.mlp(timestep_embedding(s).to(self.mlp[0].weight.dtype))


class CausalSelfAttention(nn.Module):
    def __init__(self, c: LoopFormerConfig) -> None:
        super().__init__()
        self.n_head = c.n_head
        self.qkv = LinearGroup(c_attn=nn.Linear(c.n_embd, 3 * c.n_embd, bias=c.bias))
        self.out = LinearGroup(c_proj=nn.Linear(c.n_embd, c.n_embd, bias=c.bias))

    def forward(self, x: Tensor, t: int | None, ctx: dict[str, Any]) -> Tensor:
        b, s, d = x.shape
        (qkv,) = self.qkv(x, t)
        q, k, v = (z.view(b, s, self.n_head, -1).transpose(1, 2) for z in qkv.split(d, dim=2))
        y = attention(self, t, q, k, v, ctx).transpose(1, 2).reshape(b, s, d)
        return self.out(y, t)[0]


class MLP(nn.Module):
    def __init__(self, c: LoopFormerConfig) -> None:
        super().__init__()
        self.up = LinearGroup(c_fc=nn.Linear(c.n_embd, c.intermediate_dim, bias=c.bias))
        self.down = LinearGroup(c_proj=nn.Linear(c.intermediate_dim, c.n_embd, bias=c.bias))

    def forward(self, x: Tensor, t: int | None) -> Tensor:
        return self.down(F.gelu(self.up(x, t)[0]), t)[0]


class LoopFormerBlock(nn.Module):
    """One shared block; reads its loop's conditioning ``ctx["cond"][t]`` ``[B, n_embd]``."""

    def __init__(self, c: LoopFormerConfig) -> None:
        super().__init__()
        self.attn = CausalSelfAttention(c)
        self.mlp = MLP(c)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(c.n_embd, 4 * c.n_embd))

    def forward(self, h: Tensor, t: int, ctx: dict[str, Any]) -> Tensor:
        modulation = self.adaLN_modulation(ctx["cond"][t]).unsqueeze(1)
        gate_attn, gate_mlp, scale_attn, scale_mlp = modulation.chunk(4, dim=-1)
        h = h + gate_attn * self.attn(rms_norm(h, None, None) * (1 + scale_attn), t, ctx)
        return h + gate_mlp * self.mlp(rms_norm(h, None, None) * (1 + scale_mlp), t)


class SharedStack(nn.Module):
    """Upstream ``SharedBlock``: the blocks applied once per loop (kept for the ``transformer.h.blocks`` names)."""

    def __init__(self, c: LoopFormerConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(LoopFormerBlock(c) for _ in range(c.n_layer))


class _Transformer(nn.Module):
    """Holds the ``transformer.*`` parameters so that native names come out unchanged."""

    def __init__(self, c: LoopFormerConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.block_size, c.n_embd)
        self.h = SharedStack(c)
        self.norm_f = RMSNorm(c.n_embd)


class LoopFormerLM(LoopLM):
    """LoopFormer looped LM; ``forward(ids, steps=[...])`` runs one loop per step (default: uniform)."""

    arch = "loopformer"
    config_class = LoopFormerConfig
    config_tags: ClassVar[dict[str, str]] = {"model_type": "loopformer"}
    layer_count_fields = ("n_layer",)
    fp_module_patterns = (
        "transformer.wte",
        "transformer.wpe",
        "transformer.norm_f",
        "lm_head",
        "*adaLN_modulation*",
        "time_embedder*",
        "dt_embedder*",
    )

    def __init__(self, config: LoopFormerConfig) -> None:
        super().__init__(config)
        self.transformer = _Transformer(config)
        self.time_embedder = TimestepEmbedder(config.n_embd)
        self.dt_embedder = TimestepEmbedder(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    @property
    def default_num_loops(self) -> int:
        return self.config.loopq_default_loops

    @property
    def state_dim(self) -> int:
        return self.config.n_embd

    @property
    def loop_layers(self) -> nn.ModuleList:
        return self.transformer.h.blocks

    def resolve_num_loops(
        self, num_loops: int | None, steps: Sequence[float] | Tensor | None = None, **kwargs: Any
    ) -> int:
        """As :meth:`LoopLM.resolve_num_loops`; a given ``steps`` schedule sets the loop count to ``len(steps)``."""
        if steps is not None:
            num_loops = len(step_schedule(steps, num_loops))
        return super().resolve_num_loops(num_loops)

    @property
    def max_positions(self) -> int:
        return self.config.block_size

    def embed(
        self,
        input_ids: Tensor,
        num_loops: int,
        steps: Sequence[float] | Tensor | None = None,
        step: DecodeStep | None = None,
    ) -> tuple[Tensor, dict[str, Any]]:
        schedule = step_schedule(steps, num_loops)
        batch, seq = input_ids.shape
        seq = seq if step is None else step.position_bound() + 1
        if seq > self.config.block_size:
            raise LoopLMError(
                f"input has {seq} tokens but config.json block_size={self.config.block_size} (rows of wpe); "
                "crop the input to block_size tokens"
            )
        positions = torch.arange(seq, device=input_ids.device) if step is None else step.positions
        h = self.transformer.wte(input_ids) + self.transformer.wpe(positions)
        return h, {"steps": schedule, "cond": self.loop_conditioning(schedule, batch, h), "step": step}

    def loop_conditioning(self, steps: Sequence[float], batch: int, like: Tensor) -> list[Tensor]:
        """``c_r = TE(tau_r) + DE(dt_r)`` ``[batch, n_embd]`` per loop, tau accumulated in ``like.dtype``."""
        tau = torch.zeros(batch, dtype=like.dtype, device=like.device)
        cond: list[Tensor] = []
        for dt in steps:
            cond.append(self.time_embedder(tau) + self.dt_embedder(torch.full_like(tau, dt)))
            tau = tau + dt
        return cond

    def head(self, h: Tensor, ctx: dict[str, Any]) -> Tensor:
        return self.lm_head(self.transformer.norm_f(h))

    # ------------------------------------------------------------------ native format
    def export_native(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        state.pop("lm_head.weight", None)  # tied: the published file stores it once, as transformer.wte.weight
        return {NATIVE_PREFIX + key: value for key, value in state.items()}

    def import_native(self, native: Mapping[str, Tensor], source: str) -> dict[str, Tensor]:
        state: dict[str, Tensor] = {}
        for key, value in native.items():
            name = key.removeprefix(NATIVE_PREFIX)
            if name in state:
                raise LoopLMError(f"{source}: {name!r} is stored both with and without the {NATIVE_PREFIX!r} prefix")
            state[name] = value
        return tie_head(state, source)

    def init_std(self, name: str) -> float:
        """Upstream's effective init: N(0, 0.02) matrices (adaLN included) and N(0, 0.02 / sqrt(2 n_layer)) residual
        projections ``c_proj`` (biases zero and norm weights one, as in :meth:`LoopLM.reset_parameters`)."""
        return 0.02 / math.sqrt(2 * self.config.n_layer) if name.endswith("c_proj.weight") else 0.02


def tie_head(state: dict[str, Tensor], source: str) -> dict[str, Tensor]:
    """Re-create ``lm_head.weight`` from ``transformer.wte.weight`` (either side may be the stored one)."""
    head = state.pop("lm_head.weight", None)
    if head is not None:
        wte = state.setdefault("transformer.wte.weight", head)
        if not torch.equal(head, wte):
            raise LoopLMError(
                f"{source}: lm_head.weight differs from transformer.wte.weight, but LoopFormer ties them; "
                "store only transformer.wte.weight"
            )
    if "transformer.wte.weight" in state:
        state["lm_head.weight"] = state["transformer.wte.weight"]
    return state
