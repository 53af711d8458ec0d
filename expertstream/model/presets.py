"""Shapes of the MoE models the synthetic writer can imitate.

Each preset carries what a llama.cpp-loadable file of its architecture needs: the MoE
shapes that decide transfer sizes (layers, experts, routing width, expert matrices), the
attention shapes, norms, rope and context, shared experts and leading dense layers, and
the routing keys the architecture reads. The vocabulary is always small (``n_vocab``):
it sizes only the embedding and output tensors. ``tiny`` and the ``tiny-*`` presets are
for tests; their ``n_ff_exp`` (192) is not a multiple of 512, so the down projection's
rows need the quantized-row padding.

qwen3next layers are hybrid: every ``full_attention_interval``-th layer has gated full
attention, the others linear attention (a gated delta net, ``LinearAttention``), each with
the same MoE block after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgument


@dataclass(frozen=True)
class DeltaNetShape:
    """The widths of a gated delta net (qwen3next's recurrent layers): key and value heads of one width."""

    k_heads: int  # llama.cpp's ssm.group_count
    v_heads: int  # ssm.time_step_rank; a multiple of k_heads
    head_dim: int  # ssm.state_size, of keys and values alike
    conv_kernel: int  # ssm.conv_kernel: tokens the causal convolution spans

    @property
    def key_dim(self) -> int:
        return self.k_heads * self.head_dim

    @property
    def value_dim(self) -> int:
        """llama.cpp's ssm.inner_size."""
        return self.v_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: queries, keys and values side by side."""
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class LinearAttention(DeltaNetShape):
    """qwen3next's recurrent layers as make-model writes them: a delta net, and which layers have one."""

    full_attention_interval: int  # layer i is full attention where (i + 1) % interval == 0


@dataclass(frozen=True)
class Yarn:
    """YaRN context extension as a file's rope.scaling keys say it (DeepSeek-V2's and gpt-oss's kind)."""

    factor: float
    original_context: int
    log_multiplier: float = 0.0  # rope.scaling.yarn_log_multiplier as converters write it (0: absent)


@dataclass(frozen=True)
class ModelPreset:
    name: str
    arch: str  # gguf's architecture name, which prefixes the metadata keys
    n_layer: int
    n_expert: int
    top_k: int
    n_embd: int
    n_ff_exp: int
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    n_ctx: int = 4096
    rope_base: float = 10000.0
    rope_dim: int | None = None  # rotated dimensions of a head, when not all
    norm_eps: float = 1e-6
    n_vocab: int = 512
    n_ff: int | None = None  # dense FFN width (leading dense layers); default n_ff_exp
    n_shared: int = 0  # shared experts (one dense FFN of n_shared * n_ff_shexp)
    n_ff_shexp: int | None = None  # width of one shared expert; default n_ff_exp
    n_dense_lead: int = 0
    # routing keys (written where the architecture reads them)
    gating: int | None = None  # expert_gating_func: 1 softmax, 2 sigmoid, 3 softmax over the selected
    weights_norm: bool | None = None
    weights_scale: float | None = None
    n_group: int = 0
    n_group_used: int = 0
    # deepseek2 multi-head latent attention
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_dim: int = 0
    v_head_dim: int = 0
    sliding_window: int = 0  # gpt-oss
    linear: LinearAttention | None = None  # qwen3next's recurrent layers
    yarn: Yarn | None = None  # rope.scaling keys (none: unscaled)

    @property
    def dense_ff(self) -> int:
        return self.n_ff if self.n_ff is not None else self.n_ff_exp

    @property
    def shared_ff(self) -> int:
        """Width of the shared-expert FFN: all shared experts side by side."""
        return self.n_shared * (self.n_ff_shexp if self.n_ff_shexp is not None else self.n_ff_exp)

    def is_recurrent(self, layer: int) -> bool:
        """Whether ``layer`` has linear attention rather than full attention."""
        return self.linear is not None and (layer + 1) % self.linear.full_attention_interval != 0


_TINY: dict[str, Any] = {"n_layer": 2, "n_expert": 8, "top_k": 2, "n_embd": 256, "n_ff_exp": 192}

# Qwen3-Next-80B-A3B's config: gated attention of 16 query and 2 key-value heads of 256, a quarter of each
# head rotated (theta 1e7), and linear attention of 16 key and 32 value heads of 128 with a 4-token
# convolution in the three layers out of four that are not full attention.
_QWEN3_NEXT: dict[str, Any] = {
    "n_head": 16,
    "n_head_kv": 2,
    "head_dim": 256,
    "rope_dim": 64,
    "rope_base": 1e7,
    "n_ctx": 262144,
    "n_shared": 1,
    "linear": LinearAttention(k_heads=16, v_heads=32, head_dim=128, conv_kernel=4, full_attention_interval=4),
}

PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset("tiny", "qwen3moe", **_TINY),
        ModelPreset("tiny-mixtral", "llama", **_TINY, norm_eps=1e-5),
        ModelPreset("tiny-qwen2moe", "qwen2moe", **_TINY, n_shared=1, n_ff_shexp=320),
        ModelPreset("tiny-gpt-oss", "gpt-oss", **_TINY, norm_eps=1e-5, sliding_window=128),
        # V3-style routing on a tiny shape: sigmoid, selection bias, 4 groups of 2, 2 used
        ModelPreset(
            "tiny-deepseek2",
            "deepseek2",
            **_TINY,
            n_head=4,
            n_head_kv=1,
            n_shared=2,
            gating=2,
            weights_norm=True,
            weights_scale=2.5,
            n_group=4,
            n_group_used=2,
            # the shared key 96 + 32 = 128 wide: a head size the attention kernels have
            kv_lora_rank=96,
            qk_nope_dim=32,
            v_head_dim=32,
            rope_dim=32,
        ),
        ModelPreset("tiny-glm4moe", "glm4moe", **_TINY, n_shared=1, weights_norm=True, weights_scale=1.5, rope_dim=32),
        # layer 0 linear attention (2 key heads, 4 value heads of 32), layer 1 full attention
        ModelPreset(
            "tiny-qwen3next",
            "qwen3next",
            **_TINY,
            rope_dim=16,
            n_shared=1,
            n_ff_shexp=320,
            linear=LinearAttention(k_heads=2, v_heads=4, head_dim=32, conv_kernel=4, full_attention_interval=2),
        ),
        ModelPreset(
            "qwen3-30b-a3b",
            "qwen3moe",
            n_layer=48,
            n_expert=128,
            top_k=8,
            n_embd=2048,
            n_ff_exp=768,
            n_head=32,
            n_head_kv=4,
            head_dim=128,
            n_ctx=40960,
            rope_base=1e6,
            n_ff=6144,
        ),
        ModelPreset(
            "gpt-oss-20b",
            "gpt-oss",
            n_layer=24,
            n_expert=32,
            top_k=4,
            n_embd=2880,
            n_ff_exp=2880,
            n_head=64,
            n_head_kv=8,
            head_dim=64,
            n_ctx=131072,
            rope_base=150000.0,
            norm_eps=1e-5,
            sliding_window=128,
        ),
        ModelPreset(
            "deepseek-v2-lite",
            "deepseek2",
            n_layer=27,
            n_expert=64,
            top_k=6,
            n_embd=2048,
            n_ff_exp=1408,
            n_head=16,
            n_head_kv=1,
            n_ctx=163840,
            n_ff=10944,
            n_shared=2,
            n_dense_lead=1,
            gating=1,
            weights_norm=False,
            weights_scale=1.0,
            kv_lora_rank=512,
            qk_nope_dim=128,
            v_head_dim=128,
            rope_dim=64,
        ),
        ModelPreset(
            "qwen1.5-moe-a2.7b",
            "qwen2moe",
            n_layer=24,
            n_expert=60,
            top_k=4,
            n_embd=2048,
            n_ff_exp=1408,
            n_head=16,
            n_head_kv=16,
            head_dim=128,
            n_ctx=8192,
            rope_base=1e6,
            n_ff=5632,
            n_shared=1,
            n_ff_shexp=5632,
        ),
        ModelPreset(
            "mixtral-8x7b",
            "llama",
            n_layer=32,
            n_expert=8,
            top_k=2,
            n_embd=4096,
            n_ff_exp=14336,
            n_head=32,
            n_head_kv=8,
            head_dim=128,
            n_ctx=32768,
            rope_base=1e6,
            norm_eps=1e-5,
        ),
        ModelPreset(
            "glm-4.5-air",
            "glm4moe",
            n_layer=46,
            n_expert=128,
            top_k=8,
            n_embd=4096,
            n_ff_exp=1408,
            n_head=96,
            n_head_kv=8,
            head_dim=128,
            n_ctx=131072,
            rope_base=1e6,
            rope_dim=64,
            norm_eps=1e-5,
            n_ff=10944,
            n_shared=1,
            n_dense_lead=1,
            weights_norm=True,
            weights_scale=1.0,
        ),
        # 512 experts, top-10, 48 MoE layers: the expert layout of the R9700 measurements in llama.cpp PR #28414,
        # with one shared expert of 512 and the dense width of 5120 the real model has.
        ModelPreset(
            "qwen3-next-80b-a3b",
            "qwen3next",
            n_layer=48,
            n_expert=512,
            top_k=10,
            n_embd=2048,
            n_ff_exp=512,
            n_ff=5120,
            **_QWEN3_NEXT,
        ),
        # The R9700 model of llama.cpp PR #28414: ffn_down has ne0 = 640, and its 891 MB (Q8_0) and 629 MB (Q5_1)
        # sizes give n_embd = 2560. In Q4_0 its experts take 67.9 GB (its mixed quants ~72 GB). Its attention,
        # linear attention and shared expert are not known: they are Qwen3-Next-80B-A3B's, with a shared
        # expert as wide as a routed one.
        ModelPreset(
            "qwen3.8-flash-next",
            "qwen3next",
            n_layer=48,
            n_expert=512,
            top_k=10,
            n_embd=2560,
            n_ff_exp=640,
            **_QWEN3_NEXT,
        ),
    )
}


def get_preset(name: str) -> ModelPreset:
    """The preset called ``name``; InvalidArgument lists the known ones otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise InvalidArgument(f"unknown model preset {name!r}", hint=f"choose one of {', '.join(PRESETS)}") from None
