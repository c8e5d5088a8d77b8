"""MoetMoEMethod: vLLM's FusedMoE method over 2-bit routed experts.

Loading streams: each checkpoint tensor lands in a per-expert staging slot through this method's
own `weight_loader`; as soon as one expert projection is complete (weight plus its scales) it is
sharded for tensor parallelism, requantized (moet.quant) into the layer's stacked 2-bit tensors,
and the staging slot is dropped. The source weights are never held for the whole model.
gpt-oss's fused MXFP4 tensors arrive one layer's tensor at a time, already narrowed for tensor
parallelism by vLLM, and are split into the same per-expert projections (gate/up de-interleaved);
its per-expert biases are kept in float32 for the CPU forward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.all2all_utils import maybe_make_prepare_finalize
from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG, FusedMoEQuantConfig
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP

from moet.errors import CheckpointError, ConfigError
from moet.formats.source import ExpertKey, SourceWeight
from moet.kernels.oracle import convert_to_moe_kernel_format
from moet.quant.codebook import Tier, unpack_nibbles, zero_counts, zero_policy_from_counts
from moet.quant.requant import dequantize_fp8_block
from moet.quant.scales import ScaleKind
from moet.quant.stacked import StackedWeight
from moet.vllm import moe_op
from moet.vllm.engine import MoetEngine
from moet.vllm.tiers import uses_tiers

if TYPE_CHECKING:
    from moet.vllm.config import MoetConfig

logger = logging.getLogger("moet")

# Tensors each source kind stores per expert projection; the first is the weight itself.
SOURCE_SUFFIXES = {
    "nvfp4": ("weight", "weight_scale", "weight_scale_2"),
    "mxfp4": ("weight", "weight_scale"),
    "fp8_block": ("weight", "weight_scale_inv"),
    "float": ("weight",),
}
# Loaded and dropped: activation scales do not apply to a weight-only path.
IGNORED_SUFFIXES = ("input_scale",)
SHARD_PROJ = {"w1": "gate", "w3": "up", "w2": "down"}  # vLLM shard id → projection; also the order of moet_done
# gpt-oss's fused w13 interleaves gate (even rows) and up (odd rows); the stacked w13 is gate rows then up rows.
FUSED_SHARDS = {"w13": (("w1", slice(0, None, 2)), ("w3", slice(1, None, 2))), "w2": (("w2", slice(None)),)}


class MoetMoEMethod(FusedMoEMethodBase):
    """Routed experts as a sign-symmetric 2-bit base (+ FP4 tier when VLLM_MOE_W2_DELTA_GB > 0)."""

    def __init__(self, moe: Any, config: "MoetConfig") -> None:
        super().__init__(moe)
        # Before any weight is read: the knob rules that depend on the device.
        config.knobs.check_placement(torch.get_default_device().type)
        self.config = config
        self.kind = config.kind
        self.tiered = uses_tiers(config.knobs)

    def create_weights(
        self,
        layer: torch.nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra: Any,
    ) -> None:
        if getattr(layer, "apply_router_weight_on_input", False):
            raise CheckpointError(f"{layer.layer_name}: router weights applied on the input are not supported")
        from vllm.config import get_current_vllm_config

        self._check_biased(layer)
        scale_kind = ScaleKind.of_source(self.kind)
        inter = intermediate_size_per_partition
        if self.config.engine is None:
            model_dir = get_current_vllm_config().model_config.model
            moe = self.moe
            self.config.engine = MoetEngine(self.config.knobs, model_dir, moe.tp_size, moe.tp_rank,
                                            expert_ids=_local_expert_ids(layer), rank=moe.ep_rank if moe.use_ep else moe.tp_rank,
                                            agree=_ranks_max(moe.use_ep))
        engine = layer.moet_engine = self.config.engine
        layer.moet_ordinal = engine.add_layer()  # this layer's index among the model's MoE layers: its pack layer
        # Under the device cache the base stays in the host store: the layer holds shapes only. For a
        # GPU the experts are quantized on the host and re-laid onto the GPU layer by layer (one layout).
        layer.moet_device = torch.get_default_device()
        device = "meta" if self.config.knobs.base_cache_gb > 0 else "cpu"
        layer.moet_w13 = StackedWeight.empty(num_experts, 2 * inter, hidden_size, scale_kind, engine.tier, device)
        layer.moet_w2 = StackedWeight.empty(num_experts, hidden_size, inter, scale_kind, engine.tier, device)
        layer.moet_cache = None
        layer.moet_prefill_fp8 = self.config.knobs.prefill_fp8
        layer.moet_staging = {}
        layer.moet_done = torch.zeros(num_experts, len(SHARD_PROJ), dtype=torch.bool)
        layer.moet_fused_staging = {}
        loader = self._weight_loader(layer)
        for stem in ("w13", "w2"):
            for suffix in SOURCE_SUFFIXES[self.kind] + IGNORED_SUFFIXES:
                placeholder = torch.nn.Parameter(torch.empty(0), requires_grad=False)
                placeholder.weight_loader = loader
                layer.register_parameter(f"{stem}_{suffix}", placeholder)
        layer.moet_w13_bias = layer.moet_w2_bias = None
        if self.moe.has_bias:  # gpt-oss: float32 per expert, w13's de-interleaved like its rows (gate then up)
            for stem, rows in (("w13", 2 * inter), ("w2", hidden_size)):
                bias = torch.nn.Parameter(torch.zeros(num_experts, rows, dtype=torch.float32), requires_grad=False)
                bias.weight_loader = loader
                layer.register_parameter(f"{stem}_bias", bias)
                setattr(layer, f"moet_{stem}_bias", bias)

    def _check_biased(self, layer: torch.nn.Module) -> None:
        """Refuse, before loading, what expert biases and swigluoai (gpt-oss) are not served with."""
        oai = self.moe.activation.value == "swigluoai"
        if not (oai or self.moe.has_bias):
            return
        if torch.get_default_device().type == "cuda":
            raise CheckpointError(
                f"{layer.layer_name}: expert biases and the swigluoai activation (gpt-oss) are served on CPU only, "
                "the GPU kernels have neither; serve on CPU or set VLLM_MOE_W2=0 for stock vLLM"
            )
        if self.config.knobs.base_cache_gb > 0:
            raise ConfigError(
                f"{self.config.knobs.setting('base_cache_gb')}: the device expert cache does not carry expert biases "
                f"({layer.layer_name}, gpt-oss); unset it"
            )
        if oai and self.kind == "float":
            raise CheckpointError(
                f"{layer.layer_name}: vLLM copies gpt-oss's fused bf16 experts past the quantization method's loader; "
                "serve its MXFP4 checkpoint, or set VLLM_MOE_W2=0 for stock vLLM"
            )

    def _weight_loader(self, layer: torch.nn.Module) -> Callable[..., bool | None]:
        def weight_loader(
            param: torch.nn.Parameter,
            loaded_weight: torch.Tensor,
            weight_name: str,
            shard_id: str,
            expert_id: int,
            return_success: bool = False,
        ) -> bool | None:
            ok = self._stage(layer, loaded_weight, weight_name, shard_id, expert_id)
            return ok if return_success else None

        return weight_loader

    def _stage(self, layer: torch.nn.Module, tensor: torch.Tensor, name: str, shard_id: str | None, expert_id: int | None) -> bool:
        stem, suffix = name.rsplit(".", 1)[-1].split("_", 1)
        if suffix == "bias":
            return self._load_fused_bias(layer, tensor, name, stem, shard_id)
        if suffix in IGNORED_SUFFIXES or self.tiered:  # tiered experts come from the pack
            return True
        if shard_id is None:  # gpt-oss: a whole [E, N, K/2] tensor, already narrowed for this rank
            slot = layer.moet_fused_staging.setdefault(stem, {})
            slot[suffix] = tensor.detach().to("cpu", copy=True)
            if all(s in slot for s in SOURCE_SUFFIXES[self.kind]):
                del layer.moet_fused_staging[stem]
                self._quantize_fused(layer, stem, slot, name)
            return True
        if shard_id not in SHARD_PROJ:
            raise CheckpointError(f"{name}: expert shard {shard_id!r} is not supported (per-expert w1/w2/w3 or fused gpt-oss tensors)")
        local = layer._map_global_expert_id_to_local_expert_id(expert_id)
        if local < 0:
            return False
        slot = layer.moet_staging.setdefault((local, shard_id), {})
        slot[suffix] = tensor.detach().to("cpu", copy=True)
        if all(s in slot for s in SOURCE_SUFFIXES[self.kind]):
            del layer.moet_staging[(local, shard_id)]
            self._quantize_into(layer, local, expert_id, shard_id, slot, name)
        return True

    def _fused_experts(self, layer: torch.nn.Module, tensor: torch.Tensor, name: str, shape: tuple[int, ...]) -> list[tuple[int, int]]:
        """(global, local) expert ids of this rank in a fused tensor of `shape` per expert, checked first."""
        if tuple(tensor.shape) != (self.moe.num_experts, *shape):
            raise CheckpointError(
                f"{name}: fused expert tensor is {list(tensor.shape)}, expected {[self.moe.num_experts, *shape]} "
                "(expert parallelism is not supported for fused gpt-oss experts); re-export the checkpoint"
            )
        ids = [(e, layer._map_global_expert_id_to_local_expert_id(e)) for e in range(self.moe.num_experts)]
        return [(e, local) for e, local in ids if local >= 0]

    def _quantize_fused(self, layer: torch.nn.Module, stem: str, slot: dict[str, torch.Tensor], name: str) -> None:
        """A gpt-oss fused MXFP4 tensor, expert by expert and projection by projection, with the zero policy
        decided on the whole tensor (as moet.formats reads it, so `moet quantize` dumps the same codes)."""
        weight, scales = slot["weight"].view(torch.uint8), slot["weight_scale"].view(torch.uint8)
        stacked = layer.moet_w13 if stem == "w13" else layer.moet_w2
        n, k = stacked.shape
        tensor = f"{name.rsplit('.', 1)[0]}.{stem}_weight"
        experts = self._fused_experts(layer, weight, tensor, (n, k // 2))
        self._fused_experts(layer, scales, f"{tensor}_scale", (n, k // stacked.scale_kind.block))
        counts = [zero_counts(unpack_nibbles(weight[e])) for e in range(weight.shape[0])]
        policy = zero_policy_from_counts(sum(c[0] for c in counts), sum(c[1] for c in counts))
        for expert, local in experts:
            for shard_id, rows in FUSED_SHARDS[stem]:
                part = {"weight": weight[expert, rows].contiguous(), "weight_scale": scales[expert, rows].contiguous()}
                self._quantize_into(layer, local, expert, shard_id, part, f"{tensor}[{expert}]", fused_policy=policy)

    def _load_fused_bias(self, layer: torch.nn.Module, tensor: torch.Tensor, name: str, stem: str, shard_id: str | None) -> bool:
        """gpt-oss's per-expert biases [E, N] (vLLM narrowed w13's rows and zeroed w2's on ranks > 0)."""
        if shard_id is not None:
            raise CheckpointError(f"{name}: per-expert bias tensors are not supported (only gpt-oss's fused [E, N] biases)")
        target = getattr(layer, f"moet_{stem}_bias")
        bias = tensor.detach().to("cpu", torch.float32)
        for expert, local in self._fused_experts(layer, bias, name, tuple(target.shape[1:])):
            target.data[local] = torch.cat([bias[expert, rows] for _, rows in FUSED_SHARDS[stem]])
        return True

    def _quantize_into(
        self,
        layer: torch.nn.Module,
        local: int,
        expert_id: int,
        shard_id: str,
        slot: dict[str, torch.Tensor],
        name: str,
        fused_policy: tuple[str, int] | None = None,
    ) -> None:
        """`fused_policy`: the slot is a slice of a fused tensor, already narrowed for this rank by vLLM, whose
        zero policy was decided on the whole tensor."""
        layer_index = _layer_index(layer.layer_name)
        key = ExpertKey(layer_index, expert_id, SHARD_PROJ[shard_id])  # type: ignore[arg-type]
        src = self._source(slot, key, name, fused_policy)
        qw = layer.moet_engine.quantize(src, sharded=fused_policy is not None)
        if shard_id == "w2":
            layer.moet_w2.put(local, slice(None), qw)
        else:
            inter = layer.moet_w13.shape[0] // 2
            rows = slice(0, inter) if shard_id == "w1" else slice(inter, 2 * inter)
            layer.moet_w13.put(local, rows, qw)
        layer.moet_done[local, list(SHARD_PROJ).index(shard_id)] = True

    def _source(self, slot: dict[str, torch.Tensor], key: ExpertKey, name: str, zero_policy: tuple[str, int] | None = None) -> SourceWeight:
        weight = slot["weight"]
        scales = slot.get("weight_scale", slot.get("weight_scale_inv"))
        if self.kind in ("nvfp4", "mxfp4"):
            weight, scales = weight.view(torch.uint8), scales.view(torch.uint8)
        scale_2 = float(slot["weight_scale_2"].reshape(-1)[0]) if "weight_scale_2" in slot else None
        if self.kind == "fp8_block":
            weight, scales = dequantize_fp8_block(weight, scales), None
        kind = "float" if self.kind == "fp8_block" else self.kind
        src = SourceWeight(name=name, key=key, kind=kind, data=weight, scales=scales, scale_2=scale_2, file="", zero_policy=zero_policy)
        _check_finite(src)
        return src

    def _load_from_tiers(self, layer: torch.nn.Module) -> None:
        """The layer's experts from the pack: resident stacked tensors, or rows of the device cache."""
        tiers = layer.moet_engine.expert_tiers(layer.moet_device)
        if tiers.cache is not None:
            layer.moet_cache = tiers
        else:
            tiers.fill(layer.moet_ordinal, layer.moet_w13, layer.moet_w2)
        layer.moet_done.fill_(True)

    def get_fused_moe_quant_config(self, layer: torch.nn.Module) -> FusedMoEQuantConfig:
        """Activations enter the experts unquantized (the 2-bit experts carry their own scales), so vLLM's
        prepare/finalize moves plain activations."""
        return FUSED_MOE_UNQUANTIZED_CONFIG

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if self.tiered:
            self._load_from_tiers(layer)
        missing = (~layer.moet_done).nonzero().tolist()
        if missing or layer.moet_staging:
            (expert, shard), *_ = missing or [(e, list(SHARD_PROJ).index(sid)) for e, sid in layer.moet_staging]
            wanted = ", ".join(SOURCE_SUFFIXES[self.kind])
            raise CheckpointError(
                f"{layer.layer_name}: expert {expert} {list(SHARD_PROJ.values())[shard]}_proj is incomplete in the "
                f"checkpoint (needs {wanted}); re-export the checkpoint"
            )
        for stem in ("w13", "w2"):
            for suffix in SOURCE_SUFFIXES[self.kind] + IGNORED_SUFFIXES:
                delattr(layer, f"{stem}_{suffix}")
        del layer.moet_staging, layer.moet_done
        engine = layer.moet_engine
        if layer.moet_cache is not None:
            self._from_cache(layer)
        elif layer.moet_device.type == "cuda":
            self._to_gpu(layer)
        else:
            layer.moet_fp4 = engine.fp4_runtime(layer.moet_w13.num_experts, _host_tier_bytes(layer.moet_w13, layer.moet_w2),
                                                layer.moet_device)
            engine.summary.layer_done(layer.moet_w13, layer.moet_w2, layer.moet_device)
        self._init_moe_kernel(layer)
        if layer.moet_device.type == "cpu" and torch.cpu._is_amx_tile_supported():
            # vLLM's CPU attention uses AMX tiles but relies on its own MoE kernel to request them
            # from the kernel (arch_prctl); without that request the first attention call is SIGILL.
            torch.cpu._init_amx()

    def _init_moe_kernel(self, layer: torch.nn.Module) -> None:
        """vLLM's modular kernel: its prepare/finalize for the parallel layout (under expert parallelism with
        data parallelism, the all2all backend the platform offers, instead of vLLM's naive dispatch for
        methods without one) around MoetExperts, as vLLM's own quantization methods build theirs."""
        self.moe_quant_config = self.get_fused_moe_quant_config(layer)
        prepare_finalize = maybe_make_prepare_finalize(
            self.moe, self.moe_quant_config, routing_tables=layer._expert_routing_tables(), allow_new_interface=True
        )
        self.moe_kernel = mk.FusedMoEKernel(prepare_finalize, MoetExperts(self.moe, self.moe_quant_config, layer))

    def _from_cache(self, layer: torch.nn.Module) -> None:
        """The experts as the device cache's slots (the base stays in the host store); on a GPU with the FP4
        pool, the pool's host copies of this layer are read from the pack."""
        engine, tiers, device = layer.moet_engine, layer.moet_cache, layer.moet_device
        shapes13, shapes2 = layer.moet_w13, layer.moet_w2  # "meta" tensors: shapes and sizes only
        w13, w2 = tiers.cache_weights()
        fp4_host = []
        if device.type == "cuda":
            if engine.tier != Tier.NONE:
                fp4_host = tiers.fp4_host_words(layer.moet_ordinal, shapes13, shapes2, device)
            layer.moet_fp4 = engine.fp4_runtime(shapes13.num_experts, w13.fp4_nbytes() + w2.fp4_nbytes(), device)
            if layer.moet_fp4 is not None:
                layer.moet_fp4.add_layer(layer.moet_ordinal, *fp4_host)
        else:
            layer.moet_fp4 = engine.fp4_runtime(shapes13.num_experts, _host_tier_bytes(shapes13, shapes2), device)
        engine.summary.layer_done(shapes13, shapes2, torch.device("cpu"), fp4_host)  # the base is in the host store
        layer.moet_w13, layer.moet_w2 = w13, w2

    def _to_gpu(self, layer: torch.nn.Module) -> None:
        """The experts in the GPU backends' one layout (moet.kernels.oracle)."""
        engine = layer.moet_engine
        w13, w2, fp4_host = convert_to_moe_kernel_format(layer.moet_w13, layer.moet_w2, layer.moet_device, engine.tier != Tier.NONE)
        slot_bytes = w13.fp4_nbytes() + w2.fp4_nbytes()
        layer.moet_fp4 = engine.fp4_runtime(w13.shape[0], slot_bytes, layer.moet_device)
        if layer.moet_fp4 is not None:
            layer.moet_fp4.add_layer(layer.moet_ordinal, *fp4_host)
        engine.summary.layer_done(w13, w2, layer.moet_device, fp4_host)
        layer.moet_w13, layer.moet_w2 = w13, w2

    def apply(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: Any = None,
        shared_experts_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.moe_kernel.apply(
            hidden_states=x,
            w1=layer.moet_w13.scales,  # MoetExperts reads the layer itself; these give the local expert count
            w2=layer.moet_w2.scales,
            topk_weights=topk_weights,
            topk_ids=topk_ids,
            activation=layer.activation,
            global_num_experts=layer.global_num_experts,
            expert_map=layer.expert_map,
            apply_router_weight_on_input=False,  # refused in create_weights
            shared_experts=shared_experts,
            shared_experts_input=shared_experts_input,
        )


class MoetExperts(mk.FusedMoEExpertsModular):
    """The routed-expert forward of a 2-bit layer as vLLM's modular-kernel experts: it reads the layer's own
    tensors and tiers (moe_op.apply_moe, the same computation as without the kernel) and returns the
    output already weighted and summed over the top-k."""

    def __init__(self, moe_config: Any, quant_config: FusedMoEQuantConfig, layer: torch.nn.Module) -> None:
        super().__init__(moe_config, quant_config)
        self.layer = layer

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    @staticmethod
    def _supports_current_device() -> bool:
        return True

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_quant_scheme(weight_key: Any, activation_key: Any) -> bool:
        return activation_key is None

    @staticmethod
    def _supports_activation(activation: Any) -> bool:
        return True  # the plugin refuses, at create_weights, what it does not serve

    @staticmethod
    def _supports_parallel_config(moe_parallel_config: Any) -> bool:
        return True

    def moe_problem_size(self, a1: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor) -> tuple[int, int, int, int, int]:
        """(E, M, N, K, top-k): the 2-bit tensors are not [E, N, K] (codes, or the GPU kernels' tiles), and
        only M and K size the output."""
        return w1.shape[0], a1.size(0), 0, a1.size(-1), topk_ids.size(1)

    def workspace_shapes(self, M: int, N: int, K: int, topk: int, global_num_experts: int, local_num_experts: int,
                         expert_tokens_meta: Any, activation: Any) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        return (0,), (0,), (M, K)

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return TopKWeightAndReduceNoOP()

    def apply(self, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: Any, global_num_experts: int,
              expert_map: torch.Tensor | None, a1q_scale: torch.Tensor | None, a2_scale: torch.Tensor | None,
              workspace13: torch.Tensor, workspace2: torch.Tensor, expert_tokens_meta: Any,
              apply_router_weight_on_input: bool) -> None:
        output.copy_(moe_op.apply_moe(self.layer, hidden_states, topk_weights, topk_ids))


def _local_expert_ids(layer: torch.nn.Module) -> list[int] | None:
    """Under expert parallelism the global ids of this rank's experts, in local order; None without it."""
    expert_map = layer.expert_map_manager.expert_map
    if expert_map is None:
        return None
    ids = [-1] * layer.local_num_experts
    for global_id, local in enumerate(expert_map.tolist()):
        if local >= 0:
            ids[local] = global_id
    return ids


def _ranks_max(use_ep: bool) -> Callable[[int], int] | None:
    """The largest of a count over the ranks that run each forward pass together (their collectives pair):
    the expert-parallel group under expert parallelism, the tensor-parallel group otherwise; None on one
    rank. A host all-reduce over the group's gloo side: the replay and the gate decide on it."""
    from vllm.distributed import get_ep_group, get_tp_group

    group = get_ep_group() if use_ep else get_tp_group()
    if group.world_size == 1:
        return None

    def ranks_max(count: int) -> int:
        value = torch.tensor([count], dtype=torch.int64)
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX, group=group.cpu_group)
        return int(value)

    return ranks_max


def _layer_index(layer_name: str) -> int:
    """The decoder layer number in a module name like model.layers.7.mlp.experts."""
    parts = layer_name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return -1


def _check_finite(src: SourceWeight) -> None:
    if src.kind == "float" and not bool(torch.isfinite(src.data).all()):
        raise CheckpointError(f"{src.name}: NaN or Inf in the expert weights; the checkpoint is corrupt")
    nan_scale = {"nvfp4": (0x7F, 0x7F), "mxfp4": (0xFF, 0xFF)}.get(src.kind)
    if nan_scale and bool(((src.scales & nan_scale[0]) == nan_scale[1]).any()):
        raise CheckpointError(f"{src.name}: NaN block scale in weight_scale; the checkpoint is corrupt")
    if src.scale_2 is not None and not (src.scale_2 == src.scale_2 and abs(src.scale_2) != float("inf")):
        raise CheckpointError(f"{src.name}: weight_scale_2 is NaN or Inf; the checkpoint is corrupt")


def _host_tier_bytes(w13: StackedWeight, w2: StackedWeight) -> int:
    """One expert's FP4 tier as the CPU path holds it (planes or refinement, both projections)."""
    return (w13.tier_nbytes() + w2.tier_nbytes()) // max(w13.num_experts, 1)
