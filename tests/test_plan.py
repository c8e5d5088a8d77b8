"""`moet plan` on the frontier geometries, from real safetensors headers over sparse files (no weight bytes stored).

Geometries: the kernel and e2e benches' tables (moet/bench/kernels.py GEOMETRIES, moet/bench/e2e.py
FRONTIER) for the experts, the models' published configs for the rest (Kimi-K2, Qwen3-235B-A22B);
DeepSeek-V4-Flash's 24 MoE layers are e2e.py's assumption, GLM-5.2's 78 layers follow from its 753B
parameters at 9.66B routed weights per layer. GLM-5.2 is written with the DeepSeek-V3 class (MLA,
the same expert naming): moet's reader names no GLM architecture. Every expected byte count below is
worked out by hand from the shapes, in float64, never by the code under test.
"""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from moet.commands.plan import make, startup_check
from moet.errors import MoetError
from moet.knobs import Knobs

GIB = 2.0**30
ELEMENT = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "U8": 1}
RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def write_sparse_safetensors(path: Path, specs: list[tuple[str, str, tuple[int, ...]]]) -> None:
    """A valid safetensors file whose data section is a hole: the header is real, no weight byte is written."""
    header, offset = {}, 0
    for name, tag, shape in specs:
        size = math.prod(shape) * ELEMENT[tag]
        header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)


def linear(name: str, n: int, k: int, fmt: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """One linear's tensors as each format stores it."""
    if fmt == "fp8_block":
        return [(f"{name}.weight", "F8_E4M3", (n, k)), (f"{name}.weight_scale_inv", "F32", (math.ceil(n / 128), math.ceil(k / 128)))]
    if fmt == "nvfp4":
        return [(f"{name}.weight", "U8", (n, k // 2)), (f"{name}.weight_scale", "F8_E4M3", (n, k // 16)),
                (f"{name}.weight_scale_2", "F32", ()), (f"{name}.input_scale", "F32", ())]
    return [(f"{name}.weight", "BF16", (n, k))]


QUANT_CONFIG = {
    "fp8_block": {"quant_method": "fp8", "weight_block_size": [128, 128]},
    "nvfp4": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": ["lm_head"]},
    "bf16": None,
}

# DeepSeek-V3-class models: MLA, shared expert, sigmoid router with correction bias, first_k dense layers.
MLA_MODELS = {
    "deepseek-v4-flash": dict(fmt="fp8_block", hidden=4096, inter=2048, experts=256, top_k=6, layers=24, dense_layers=0,
                              mtp_layers=1, heads=32, q_lora=1024, kv_lora=512, rope=64, nope=128, v=128,
                              dense_inter=11264, shared=1, vocab=129280, context=65536),
    "glm-5.2": dict(fmt="nvfp4", hidden=6144, inter=2048, experts=256, top_k=8, layers=78, dense_layers=3, mtp_layers=0,
                    heads=64, q_lora=2048, kv_lora=512, rope=64, nope=192, v=256, dense_inter=12288, shared=1,
                    vocab=154880, context=202752),
    "kimi-k2": dict(fmt="fp8_block", hidden=7168, inter=2048, experts=384, top_k=8, layers=61, dense_layers=1, mtp_layers=0,
                    heads=64, q_lora=1536, kv_lora=512, rope=64, nope=128, v=128, dense_inter=18432, shared=1,
                    vocab=163840, context=131072),
}
QWEN3_235B = dict(fmt="bf16", hidden=4096, inter=1536, experts=128, top_k=8, layers=94, heads=64, kv_heads=4, head_dim=128,
                  vocab=151936, context=40960)


def mla_checkpoint(root: Path, g: dict) -> Path:
    h, fmt = g["hidden"], g["fmt"]
    specs = [("model.embed_tokens.weight", "BF16", (g["vocab"], h)), ("model.norm.weight", "BF16", (h,)),
             ("lm_head.weight", "BF16", (g["vocab"], h))]
    for layer in range(g["layers"] + g["mtp_layers"]):
        p = f"model.layers.{layer}"
        specs += [(f"{p}.input_layernorm.weight", "BF16", (h,)), (f"{p}.post_attention_layernorm.weight", "BF16", (h,)),
                  (f"{p}.self_attn.q_a_layernorm.weight", "BF16", (g["q_lora"],)),
                  (f"{p}.self_attn.kv_a_layernorm.weight", "BF16", (g["kv_lora"],))]
        specs += linear(f"{p}.self_attn.q_a_proj", g["q_lora"], h, fmt)
        specs += linear(f"{p}.self_attn.q_b_proj", g["heads"] * (g["nope"] + g["rope"]), g["q_lora"], fmt)
        specs += linear(f"{p}.self_attn.kv_a_proj_with_mqa", g["kv_lora"] + g["rope"], h, fmt)
        specs += linear(f"{p}.self_attn.kv_b_proj", g["heads"] * (g["nope"] + g["v"]), g["kv_lora"], fmt)
        specs += linear(f"{p}.self_attn.o_proj", h, g["heads"] * g["v"], fmt)
        if layer < g["dense_layers"]:
            for proj, n, k in (("gate_proj", g["dense_inter"], h), ("up_proj", g["dense_inter"], h), ("down_proj", h, g["dense_inter"])):
                specs += linear(f"{p}.mlp.{proj}", n, k, fmt)
            continue
        specs += [(f"{p}.mlp.gate.weight", "BF16", (g["experts"], h)), (f"{p}.mlp.gate.e_score_correction_bias", "F32", (g["experts"],))]
        for proj, n, k in (("gate_proj", g["inter"], h), ("up_proj", g["inter"], h), ("down_proj", h, g["inter"])):
            specs += linear(f"{p}.mlp.shared_experts.{proj}", n, k, fmt)
            for e in range(g["experts"]):
                specs += linear(f"{p}.mlp.experts.{e}.{proj}", n, k, fmt)
    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "torch_dtype": "bfloat16",
              "hidden_size": h, "moe_intermediate_size": g["inter"], "intermediate_size": g["dense_inter"],
              "n_routed_experts": g["experts"], "num_experts_per_tok": g["top_k"], "num_hidden_layers": g["layers"],
              "first_k_dense_replace": g["dense_layers"], "num_attention_heads": g["heads"], "num_key_value_heads": g["heads"],
              "q_lora_rank": g["q_lora"], "kv_lora_rank": g["kv_lora"], "qk_rope_head_dim": g["rope"],
              "qk_nope_head_dim": g["nope"], "v_head_dim": g["v"], "n_shared_experts": g["shared"],
              "vocab_size": g["vocab"], "max_position_embeddings": g["context"], "num_nextn_predict_layers": g["mtp_layers"]}
    return _save(root, specs, config, QUANT_CONFIG[fmt])


def qwen3_checkpoint(root: Path, g: dict) -> Path:
    h, hd = g["hidden"], g["head_dim"]
    specs = [("model.embed_tokens.weight", "BF16", (g["vocab"], h)), ("model.norm.weight", "BF16", (h,)),
             ("lm_head.weight", "BF16", (g["vocab"], h))]
    for layer in range(g["layers"]):
        p = f"model.layers.{layer}"
        specs += [(f"{p}.input_layernorm.weight", "BF16", (h,)), (f"{p}.post_attention_layernorm.weight", "BF16", (h,)),
                  (f"{p}.self_attn.q_norm.weight", "BF16", (hd,)), (f"{p}.self_attn.k_norm.weight", "BF16", (hd,)),
                  (f"{p}.self_attn.q_proj.weight", "BF16", (g["heads"] * hd, h)), (f"{p}.self_attn.k_proj.weight", "BF16", (g["kv_heads"] * hd, h)),
                  (f"{p}.self_attn.v_proj.weight", "BF16", (g["kv_heads"] * hd, h)), (f"{p}.self_attn.o_proj.weight", "BF16", (h, g["heads"] * hd)),
                  (f"{p}.mlp.gate.weight", "BF16", (g["experts"], h))]
        for e in range(g["experts"]):
            for proj, n, k in (("gate_proj", g["inter"], h), ("up_proj", g["inter"], h), ("down_proj", h, g["inter"])):
                specs.append((f"{p}.mlp.experts.{e}.{proj}.weight", "BF16", (n, k)))
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "torch_dtype": "bfloat16", "hidden_size": h,
              "moe_intermediate_size": g["inter"], "num_experts": g["experts"], "num_experts_per_tok": g["top_k"],
              "num_hidden_layers": g["layers"], "num_attention_heads": g["heads"], "num_key_value_heads": g["kv_heads"],
              "head_dim": hd, "vocab_size": g["vocab"], "max_position_embeddings": g["context"]}
    return _save(root, specs, config, None, shards=2)


def _save(root: Path, specs: list, config: dict, quant: dict | None, shards: int = 1) -> Path:
    root.mkdir(parents=True)
    if quant is not None:
        config["quantization_config"] = quant
    (root / "config.json").write_text(json.dumps(config))
    if shards == 1:
        write_sparse_safetensors(root / "model.safetensors", specs)
        return root
    cut = len(specs) // shards
    weight_map = {}
    for i in range(shards):
        part = specs[i * cut : (i + 1) * cut if i < shards - 1 else len(specs)]
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        write_sparse_safetensors(root / name, part)
        weight_map.update({n: name for n, _, _ in part})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("plan")
    out = {name: mla_checkpoint(base / name, g) for name, g in MLA_MODELS.items()}
    out["qwen3-235b"] = qwen3_checkpoint(base / "qwen3-235b", QWEN3_235B)
    return out


# ---- the byte counts, by hand --------------------------------------------------------------------------


def expert_gpu_bytes(h: int, i: int, block: int) -> float:
    """One expert on the GPU: w13 [2I, H] and w2 [H, I] at 2 bits + one byte scale per block, plus f32 row scales."""
    weights = 3.0 * h * i
    return weights * 2.0 / 8.0 + weights / block + 4.0 * (2.0 * i + h)


def pack_stride(h: int, i: int, block: int) -> float:
    """A pack row: a 64-byte header, then codes, scales and row scales of w13 then w2 (each a multiple of 64
    bytes for these shapes), rounded up to 4 KiB."""
    fields = [2 * i * h / 4, 2 * i * h / block, 4 * 2 * i, h * i / 4, h * i / block, 4 * h]
    assert all(f % 64 == 0 for f in fields)
    return math.ceil((64.0 + sum(fields)) / 4096.0) * 4096.0


def mla_dense_bytes(g: dict) -> float:
    """Everything but the routed experts, in bf16 (2 bytes per weight; quantized linears dequantized, scales dropped)."""
    h = g["hidden"]
    attention = (g["q_lora"] * h + g["heads"] * (g["nope"] + g["rope"]) * g["q_lora"] + (g["kv_lora"] + g["rope"]) * h
                 + g["heads"] * (g["nope"] + g["v"]) * g["kv_lora"] + h * g["heads"] * g["v"])
    norms = 2 * h + g["q_lora"] + g["kv_lora"]
    dense_mlp = 3 * h * g["dense_inter"]
    moe_extra = g["experts"] * h + g["experts"] + 3 * h * g["inter"]  # router, its bias, one shared expert
    moe_layers = g["layers"] - g["dense_layers"]
    total = (g["layers"] * (attention + norms) + g["dense_layers"] * dense_mlp + moe_layers * moe_extra
             + 2.0 * g["vocab"] * h + h)
    return 2.0 * total


def qwen3_dense_bytes(g: dict) -> float:
    h, hd = g["hidden"], g["head_dim"]
    per_layer = 2 * h * g["heads"] * hd + 2 * h * g["kv_heads"] * hd + 2 * h + 2 * hd + g["experts"] * h
    return 2.0 * (g["layers"] * per_layer + 2.0 * g["vocab"] * h + h)


def plan_parts(plan) -> dict[str, int]:
    return {p.name: p.bytes for p in plan.parts}


def resources(**kw) -> dict:
    return {"gpus": 1, "gpu_bytes": 96 * 2**30, "ram": 512 * 2**30, "nvme": None, "max_len": 32768, **kw}


def plan_of(path: Path, knobs: Knobs | None = None, **kw):
    r = resources(**kw)
    return make(path, knobs or Knobs(w2=True), r["gpus"], r["gpu_bytes"], r["ram"], r["nvme"], r["max_len"])


@pytest.mark.parametrize("name", sorted(MLA_MODELS))
def test_mla_models_bytes_match_the_hand_counts(models: dict[str, Path], name: str) -> None:
    g = MLA_MODELS[name]
    block = 16 if g["fmt"] == "nvfp4" else 32  # an NVFP4 source keeps its e4m3/16 scales; FP8 is re-quantized to UE8M0/32
    moe_layers = g["layers"] - g["dense_layers"]
    plan = plan_of(models[name], gpus=8)
    geo, parts = plan.geometry, plan_parts(plan)
    assert (geo.moe_layers, geo.experts, geo.top_k, geo.attention) == (moe_layers, g["experts"], g["top_k"], "MLA")
    assert geo.skipped_layers == tuple(range(g["layers"], g["layers"] + g["mtp_layers"]))
    experts = moe_layers * g["experts"] * expert_gpu_bytes(g["hidden"], g["inter"], block)
    assert parts["2-bit experts"] == experts // 8
    assert parts["dense weights"] == mla_dense_bytes(g) // 8
    # MLA caches one latent (kv_lora + rope) per token and layer, in bf16, on every rank
    assert parts["KV cache"] == 32768.0 * g["layers"] * (g["kv_lora"] + g["rope"]) * 2.0
    bits = expert_gpu_bytes(g["hidden"], g["inter"], block) * 8.0 / (3.0 * g["hidden"] * g["inter"])
    assert abs(geo.base_bits_per_weight - bits) < 1e-12
    assert (2.25 if block == 32 else 2.5) < bits < (2.25 if block == 32 else 2.5) * 1.01


def test_expert_bytes_match_the_kernel_bench(models: dict[str, Path]) -> None:
    """The H200 kernel bench read 6 DeepSeek-V4-Flash / 8 Kimi-K2 experts per token: the same bytes per expert."""
    records = json.loads((RESULTS / "kernels-20261203T121135Z.json").read_text())["records"]
    for name in ("deepseek-v4-flash", "kimi-k2"):
        bench = next(r for r in records if r.get("kind") == "decode" and r["geometry"] == name and r["tokens"] == 1 and r["variant"] == "base")
        assert plan_of(models[name]).geometry.base_bytes_per_expert * bench["active_experts"] == bench["bytes"]


def test_qwen3_235b_gqa_on_one_and_two_gpus(models: dict[str, Path]) -> None:
    g = QWEN3_235B
    experts = g["layers"] * g["experts"] * expert_gpu_bytes(g["hidden"], g["inter"], 32)
    kv_one = 32768.0 * g["layers"] * 2.0 * g["kv_heads"] * g["head_dim"] * 2.0  # K and V, bf16
    one = plan_of(models["qwen3-235b"])
    assert plan_parts(one) == {"dense weights": qwen3_dense_bytes(g), "2-bit experts": experts, "FP4 pool": 0, "KV cache": kv_one,
                               # one layer's 2-bit result and one bf16 expert's source
                               "load staging": g["experts"] * expert_gpu_bytes(g["hidden"], g["inter"], 32) + 3.0 * g["hidden"] * g["inter"] * 2.0}
    assert one.fits and one.need("vram") == qwen3_dense_bytes(g) + experts + kv_one
    two = plan_parts(plan_of(models["qwen3-235b"], gpus=2))
    assert two["KV cache"] == kv_one / 2 and two["2-bit experts"] == experts // 2  # GQA heads split over the ranks


def test_kimi_k2_on_one_96g_gpu_is_refused_with_what_to_try(models: dict[str, Path]) -> None:
    g = MLA_MODELS["kimi-k2"]
    moe_layers = g["layers"] - g["dense_layers"]
    experts = moe_layers * g["experts"] * expert_gpu_bytes(g["hidden"], g["inter"], 32)
    dense, kv = mla_dense_bytes(g), 32768.0 * g["layers"] * 576 * 2.0
    budget = math.floor(0.9 * 96 * GIB)
    need = dense + experts + kv
    gpus = next(n for n in range(2, 17) if dense // n + experts // n + kv <= budget)
    cache = math.floor((budget - dense - kv) / GIB * 10) / 10
    proc = subprocess.run([sys.executable, "-m", "moet.cli", "plan", str(models["kimi-k2"]), "--gpu-mem", "96G", "--max-model-len", "32768"],
                          capture_output=True, text=True, timeout=300, env={k: v for k, v in os.environ.items() if not k.startswith("VLLM_MOE_W2")})
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr
    line, = proc.stderr.strip().splitlines()
    assert line.startswith(f"moet: error: needs {need / GIB:.1f} GiB of VRAM per GPU for dense weights {dense / GIB:.1f} + "
                           f"2-bit experts {experts / GIB:.1f} + KV cache {kv / GIB:.1f}; have {budget / GIB:.1f} (0.9 × 96.0)"), line
    assert f"try --gpus {gpus} or VLLM_MOE_W2_BASE_CACHE_GB={cache:g} " in line, line
    assert gpus == 4 and plan_of(models["kimi-k2"], gpus=4).fits


def test_glm_fp4_pool_host_copies_and_the_pack(models: dict[str, Path], tmp_path: Path) -> None:
    """A GPU pool promotes from FP4 copies of every expert in host RAM (4 bits/weight); the pack holds 4 KiB-aligned base rows."""
    g = MLA_MODELS["glm-5.2"]
    moe_layers = g["layers"] - g["dense_layers"]
    rows = moe_layers * g["experts"]
    plan = plan_of(models["glm-5.2"], Knobs(w2=True, delta_gb=8.0), gpus=4, ram=128 * 2**30, nvme=tmp_path / "packs")
    parts = plan_parts(plan)
    fp4_copies = rows * 3.0 * g["hidden"] * g["inter"] / 2.0
    assert parts["FP4 tier (host)"] == fp4_copies and parts["FP4 pool"] == 8 * GIB
    assert parts["pack"] == rows * pack_stride(g["hidden"], g["inter"], 16)
    assert not plan.fits and plan.problems[0].startswith("needs")
    assert "of host RAM for" in plan.problems[0] and plan.problems[0].endswith("; have 128.0; try VLLM_MOE_W2_DELTA_GB=0")
    host_store = rows * pack_stride(g["hidden"], g["inter"], 16)  # every base row pinned (no VLLM_MOE_W2_BASE_RAM_GB)
    assert parts["host store (2-bit base)"] == host_store
    assert plan.impossible[0] == f"needs {(fp4_copies + host_store) / GIB:.1f} GiB of host RAM for its weights alone; the host has 128.0"
    st = os.statvfs(tmp_path)
    if parts["pack"] > st.f_bavail * st.f_frsize:  # 212 GiB: more than this disk has free
        assert plan.impossible[1].startswith(f"needs {parts['pack'] / GIB:.1f} GiB on {tmp_path / 'packs'} for the pack; have ")
    else:
        assert len(plan.impossible) == 1


def test_cpu_plan_puts_everything_in_ram(models: dict[str, Path]) -> None:
    g = QWEN3_235B
    plan = plan_of(models["qwen3-235b"], gpu_bytes=None, ram=64 * 2**30)
    experts = g["layers"] * g["experts"] * expert_gpu_bytes(g["hidden"], g["inter"], 32)
    assert plan.device == "cpu" and {p.where for p in plan.parts} == {"ram"} and plan.tok_s is None
    staging = g["experts"] * expert_gpu_bytes(g["hidden"], g["inter"], 32) + 3.0 * g["hidden"] * g["inter"] * 2.0
    kv = 32768.0 * g["layers"] * 2.0 * g["kv_heads"] * g["head_dim"] * 2.0
    left = math.floor((64 * GIB - qwen3_dense_bytes(g) - kv - staging) / GIB * 10) / 10  # RAM left for experts
    assert plan.problems[0].endswith(f"; try VLLM_MOE_W2_BASE_CACHE_GB={left / 2:g} VLLM_MOE_W2_BASE_RAM_GB={left / 2:g} "
                                     "with VLLM_MOE_W2_STORE_DIR on NVMe"), plan.problems[0]
    assert plan.impossible == [f"needs {(qwen3_dense_bytes(g) + experts) / GIB:.1f} GiB of host RAM for its weights alone; the host has 64.0"]


def test_decode_prediction_from_the_named_bench_files(models: dict[str, Path]) -> None:
    """Batch 1 on an H200: LM head + each layer's non-expert time + top-k experts at the measured 2-bit bandwidth."""
    kernels = json.loads((RESULTS / "kernels-20261203T121135Z.json").read_text())["records"]
    e2e = json.loads((RESULTS / "e2e-20261203T123521Z-compiled.json").read_text())["models"]["deepseek-v4-flash"]
    base = {r["geometry"]: r for r in kernels if r.get("kind") == "decode" and r["tokens"] == 1 and r["variant"] == "base"}
    g = MLA_MODELS["deepseek-v4-flash"]
    other = e2e["projection"]["base_layer_us"] - base["deepseek-v4-flash"]["us"]
    head = e2e["head_us_b1"]  # the stand-in has DeepSeek-V4-Flash's own vocabulary and width
    moe = g["top_k"] * expert_gpu_bytes(g["hidden"], g["inter"], 32) / (base["deepseek-v4-flash"]["gbs"] * 1e3)
    plan = plan_of(models["deepseek-v4-flash"])
    assert plan.tok_s == pytest.approx(1e6 / (head + g["layers"] * (other + moe)), rel=1e-12)
    assert any("kernels-20261203T121135Z.json" in c for c in plan.constants)
    assert any("e2e-20261203T123521Z-compiled.json" in c for c in plan.constants)


def test_startup_check_refuses_only_the_impossible(models: dict[str, Path]) -> None:
    line = startup_check(Path(__file__).resolve().parents[1] / "moet" / "models" / "default", Knobs(w2=True), [])
    assert line.startswith("moet: plan: ") and "may not fit" not in line, line
    with pytest.raises(MoetError, match="for its weights alone"):  # 267 GiB of experts in this host's RAM (no GPU here)
        startup_check(models["kimi-k2"], Knobs(w2=True), ["--max-model-len", "4096"])
    assert startup_check(models["kimi-k2"], Knobs(w2=False), []) == "moet: plan: skipped (VLLM_MOE_W2=0: stock vLLM path)"


@pytest.mark.parametrize("case", ["no config.json", "corrupt header", "unknown architecture"])
def test_bad_checkpoints_fail_with_one_line_naming_the_file(tmp_path: Path, case: str) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    config = {"architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 1, "hidden_size": 64, "vocab_size": 8, "num_experts_per_tok": 1}
    if case != "no config.json":
        (root / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]} if case == "unknown architecture" else config))
    (root / "model.safetensors").write_bytes(struct.pack("<Q", 4) + b"{not" if case == "corrupt header" else b"")
    proc = subprocess.run([sys.executable, "-m", "moet.cli", "plan", str(root), "--gpu-mem", "96G"], capture_output=True, text=True, timeout=120)
    line, = proc.stderr.strip().splitlines()
    expected = {"no config.json": f"{root}: no config.json", "corrupt header": f"{root / 'model.safetensors'}: header is not valid JSON",
                "unknown architecture": f"{root / 'config.json'}: architecture 'LlamaForCausalLM' is not supported"}[case]
    assert proc.returncode == 1 and line.startswith(f"moet: error: {expected}"), line


def test_a_cached_hub_snapshot_plans_like_its_directory(tmp_path: Path) -> None:
    """MODEL may be a Hugging Face id found in the local hub cache (refs/main → snapshots/<rev>, files as links)."""
    default = Path(__file__).resolve().parents[1] / "moet" / "models" / "default"
    snapshot = tmp_path / "hub" / "models--acme--tiny-moe" / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    (tmp_path / "hub" / "models--acme--tiny-moe" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny-moe" / "refs" / "main").write_text("0123abc")
    for f in default.iterdir():
        (snapshot / f.name).symlink_to(f)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("VLLM_MOE_W2")}, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    runs = [subprocess.run([sys.executable, "-m", "moet.cli", "plan", model, "--gpu-mem", "24G", "--json"], capture_output=True,
                           text=True, timeout=120, env=env) for model in ("acme/tiny-moe", str(default))]
    assert [r.returncode for r in runs] == [0, 0], [r.stderr for r in runs]
    hub, local = (json.loads(r.stdout) for r in runs)
    assert hub["geometry"]["root"] == str(snapshot)
    assert {k: v for k, v in hub.items() if k != "geometry"} == {k: v for k, v in local.items() if k != "geometry"}
