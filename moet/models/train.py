"""Train the embedded default model: a 12-layer Qwen3-MoE on the standard library's source.

Twelve layers, not four: sign bias of a 2-bit codebook compounds with depth, and the quality
ablation needs room for it to show. Runs on CPU or GPU (bf16 autocast there), fixed seed.

    python -m moet.models.data --out .cache/default_model            # corpus + tokenizer
    python -m moet.models.train --data .cache/default_model --out .cache/default_model/master \
        --device cuda --time-budget 300 --log bench/results/default_model_train.json

`--time-budget` fixes the step count after a short calibration, capped at `--max-epochs` passes
over the 9M training tokens (the count is logged, and `--steps N` repeats it exactly); the cosine
schedule is then laid out over those steps. GPU kernels are not bit-deterministic, so a rerun
matches the loss curve, not every bit. The shipped model: `--steps 2202` (8 epochs; see
moet/models/README.md).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import platform
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

SEQ_LEN = 512
CALIBRATION_STEPS = 20


def default_config(vocab_size: int = 4096):
    """The default model's architecture (see moet/models/README.md)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=768,  # unused: every layer is sparse (decoder_sparse_step 1)
        num_hidden_layers=12,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        hidden_act="silu",
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        attention_bias=False,
        decoder_sparse_step=1,
        moe_intermediate_size=256,
        num_experts=16,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        output_router_logits=False,
        router_aux_loss_coef=0.001,
        mlp_only_layers=[],
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


def bf16_grouped_experts(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """Routed experts through torch's grouped GEMM in bf16, casting the fp32 master weights.

    grouped_mm is not autocast-aware and wants bf16 on CUDA; transformers' own path would run it
    in the weights' dtype (fp32). The casts are differentiable, so the fp32 weights get the grads.
    """
    n_tokens, top_k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = order // top_k
    offs = torch.cumsum(torch.bincount(flat, minlength=self.num_experts), 0).to(torch.int32)
    x = hidden_states[rows].to(torch.bfloat16)
    h = torch.nn.functional.grouped_mm(x, self.gate_up_proj.to(torch.bfloat16).transpose(-2, -1), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    h = self.act_fn(gate) * up
    y = torch.nn.functional.grouped_mm(h, self.down_proj.to(torch.bfloat16).transpose(-2, -1), offs=offs)
    y = y.float() * top_k_weights.reshape(-1)[order].unsqueeze(-1).float()
    out = torch.zeros(n_tokens, y.shape[-1], device=y.device, dtype=torch.float32).index_add_(0, rows, y)
    return out.to(hidden_states.dtype)


def use_fast_experts(model, device: torch.device) -> str:
    """Switch the model's experts to bf16_grouped_experts if one forward/backward works, else keep "eager"."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    model.config._experts_implementation = "eager"
    if device.type != "cuda":
        return "eager"
    try:
        ALL_EXPERTS_FUNCTIONS.register("moet_bf16_grouped", bf16_grouped_experts)
        model.config._experts_implementation = "moet_bf16_grouped"
        probe = torch.randint(0, model.config.vocab_size, (2, 64), device=device)
        with _autocast(device):
            model(input_ids=probe).logits.float().mean().backward()
        model.zero_grad(set_to_none=True)
        return "moet_bf16_grouped"
    except Exception as exc:  # noqa: BLE001 — any failure means: use the slow but safe loop
        print(f"grouped experts unavailable ({exc!r}); using eager", flush=True)
        model.zero_grad(set_to_none=True)
        model.config._experts_implementation = "eager"
        return "eager"


def load_tokens(path: Path, device: torch.device) -> torch.Tensor:
    """A uint16 .npy token stream as int64 on `device`."""
    return torch.from_numpy(np.load(path).astype(np.int64)).to(device)


def eval_windows(ids: torch.Tensor, n_windows: int, seq_len: int = SEQ_LEN) -> torch.Tensor:
    """`n_windows` non-overlapping windows of seq_len + 1 tokens, evenly spaced over the stream."""
    span = seq_len + 1
    total = ids.numel() // span
    n = min(n_windows, total)
    starts = (torch.arange(n, device=ids.device) * total // n) * span
    return ids[starts.unsqueeze(1) + torch.arange(span, device=ids.device)]


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float) -> float:
    """Linear warm-up, then cosine decay to floor × peak at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


@torch.no_grad()
def heldout_loss(model, windows: torch.Tensor, batch: int) -> float:
    """Mean next-token cross-entropy (nats) over the held-out windows."""
    model.eval()
    total, count = 0.0, 0
    device = windows.device
    for i in range(0, windows.shape[0], batch):
        w = windows[i : i + batch]
        with _autocast(device):
            logits = model(input_ids=w[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten(), reduction="sum")
        total += float(loss)
        count += w[:, 1:].numel()
    model.train()
    return total / count


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Train, save the bf16 master under args.out, and return the training log."""
    from transformers import GenerationConfig, Qwen3MoeForCausalLM

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    data = Path(args.data)
    train_ids = load_tokens(data / "train.npy", device)
    heldout = eval_windows(load_tokens(data / "heldout.npy", device), args.eval_windows)
    config = default_config()
    model = Qwen3MoeForCausalLM(config).to(device)
    experts_impl = use_fast_experts(model, device)
    n_params = sum(p.numel() for p in model.parameters())
    n_expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optim = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )
    gen = torch.Generator().manual_seed(args.seed)
    span = SEQ_LEN + 1
    total_steps = args.steps
    log: dict[str, Any] = {"loss": [], "heldout": []}
    t0 = time.perf_counter()
    step = 0
    while total_steps is None or step < total_steps:
        if total_steps is None and step == CALIBRATION_STEPS:
            if device.type == "cuda":
                torch.cuda.synchronize()
            per_step = (time.perf_counter() - t_cal) / (CALIBRATION_STEPS - 5)
            by_epochs = int(args.max_epochs * train_ids.numel() / (args.batch * SEQ_LEN))
            total_steps = max(CALIBRATION_STEPS, min(int(args.time_budget / per_step), by_epochs))
            print(f"calibrated: {per_step * 1e3:.1f} ms/step → {total_steps} steps", flush=True)
        if step == 5:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_cal = time.perf_counter()
        lr = lr_at(step, total_steps or 10**9, args.lr, args.warmup, args.lr_floor)
        for group in optim.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, train_ids.numel() - span, (args.batch,), generator=gen).to(device)
        batch = train_ids[starts.unsqueeze(1) + torch.arange(span, device=device)]
        with _autocast(device):
            out = model(input_ids=batch[:, :-1], output_router_logits=True)
        ce = torch.nn.functional.cross_entropy(out.logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss = ce + config.router_aux_loss_coef * out.aux_loss.float()
        optim.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optim.step()
        step += 1
        if step % args.log_every == 0 or step == 1:
            entry = {
                "step": step,
                "ce": round(float(ce.detach()), 4),
                "aux": round(float(out.aux_loss.detach()), 4),
                "lr": lr,
                "grad_norm": round(float(grad_norm), 3),
                "seconds": round(time.perf_counter() - t0, 1),
            }
            log["loss"].append(entry)
            print(json.dumps(entry), flush=True)
        if step % args.eval_every == 0 or step == total_steps:
            h = heldout_loss(model, heldout, args.batch)
            log["heldout"].append({"step": step, "ce": round(h, 4), "ppl": round(math.exp(h), 3)})
            print(f"step {step}: held-out ce {h:.4f} ppl {math.exp(h):.3f}", flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    out_dir = Path(args.out)
    model.config._experts_implementation = None
    model.to(torch.bfloat16).save_pretrained(out_dir, max_shard_size=args.max_shard_size)
    GenerationConfig(bos_token_id=0, eos_token_id=0, pad_token_id=0).save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(data / name, out_dir / name)
    corpus = json.loads((data / "corpus.json").read_text())
    corpus.pop("heldout_files", None)
    import transformers

    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "experts_implementation": experts_impl,
        "params": {"total": n_params, "routed_experts": n_expert},
        "steps": step,
        "tokens": step * args.batch * SEQ_LEN,
        "epochs": round(step * args.batch * SEQ_LEN / train_ids.numel(), 3),
        "wall_seconds": round(wall, 1),
        "corpus": corpus,
        "final_heldout": log["heldout"][-1] if log["heldout"] else None,
        **log,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path(".cache/default_model"), help="output of moet.models.data")
    parser.add_argument("--out", type=Path, default=Path(".cache/default_model/master"), help="bf16 master (HF dir)")
    parser.add_argument("--log", type=Path, default=None, help="training log JSON")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=None, help="fixed step count (else from --time-budget)")
    parser.add_argument("--time-budget", type=float, default=300.0, help="seconds of training when --steps is unset")
    parser.add_argument(
        "--max-epochs", type=float, default=4.0, help="cap on passes over the corpus (time-budget mode); held-out loss was lowest at ~4.5"
    )
    parser.add_argument("--batch", type=int, default=64, help="sequences of 512 tokens per step")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--lr-floor", type=float, default=0.1, help="final lr as a fraction of the peak")
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--eval-windows", type=int, default=64, help="held-out windows for the running eval")
    parser.add_argument("--max-shard-size", default="15MB")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = train(args)
    text = json.dumps(result, indent=2) + "\n"
    if args.log is not None:
        args.log.parent.mkdir(parents=True, exist_ok=True)
        args.log.write_text(text)
    print(json.dumps({k: result[k] for k in ("steps", "tokens", "epochs", "wall_seconds", "final_heldout")}))


if __name__ == "__main__":
    main()
