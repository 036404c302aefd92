"""How long `switch.rollout()` takes to refresh a real Megatron-Core model (TP = PP = DP = 1,
one GPU), beside the naive path (every parameter copied into a separate bf16 rollout model) on
the same parameters, in one process; the model's Hugging Face config is written out so the
Rust Megatron backend can be timed on the same shapes in the same job:

    python python/bench/megatron_enter.py [--layers 28] [--iters 5] --config-out cfg.json
    megatron_bench --world 1 --skip-offload --iters 5 --config cfg.json

The model: a Megatron-Core 0.19 `GPTModel` with the local spec in Qwen3-1.7B's shapes (hidden
2048, 16 heads in 8 query groups of 128, ffn 6144, vocab 151936, q / k norms, no biases) with an
untied head (2.03 B parameters at 28 layers), in `Float16Module` and `DistributedDataParallel`
with the distributed optimizer (Adam), random weights. Prints one JSON object (and writes it to
$OUT/megatron_enter.json when OUT is set).
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

import lifecycle

SHAPES = dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16,
              num_key_value_heads=8, head_dim=128, vocab_size=151936)


def hf_config(layers: int) -> dict:
    return {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], **SHAPES,
        "num_hidden_layers": layers, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "attention_bias": False, "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
    }


def build(layers: int):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=layers, hidden_size=SHAPES["hidden_size"],
        num_attention_heads=SHAPES["num_attention_heads"],
        num_query_groups=SHAPES["num_key_value_heads"], kv_channels=SHAPES["head_dim"],
        ffn_hidden_size=SHAPES["intermediate_size"], normalization="RMSNorm",
        layernorm_epsilon=1e-6, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, add_qkv_bias=False, qk_layernorm=True, bf16=True,
        params_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0,
    )
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True),
        vocab_size=SHAPES["vocab_size"], max_sequence_length=4096,
        position_embedding_type="rope", rotary_base=1000000,
        share_embeddings_and_output_weights=False,
    ).cuda()
    model = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True),
        Float16Module(config, gpt),
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-5, bf16=True, use_distributed_optimizer=True),
        [model],
    )
    return model, gpt, opt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--config-out", help="write the model's Hugging Face config here")
    args = ap.parse_args()
    cfg = hf_config(args.layers)
    if args.config_out:
        with open(args.config_out, "w") as f:
            json.dump(cfg, f)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29543")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    t0 = time.perf_counter()
    model, gpt, opt = build(args.layers)
    torch.cuda.synchronize()
    params = sum(p.numel() for p in gpt.parameters())
    res = {"layers": args.layers, "params": params, "build_s": time.perf_counter() - t0,
           "torch": torch.__version__, "device": torch.cuda.get_device_name()}

    # one training step of Megatron's own, so the optimizer state exists as in a real run
    ids = torch.randint(0, SHAPES["vocab_size"], (1, 64), device="cuda")
    pos = torch.arange(64, device="cuda").unsqueeze(0)
    model(ids, pos, None, labels=ids).float().mean().backward()
    model.finish_grad_sync()
    opt.step()
    opt.zero_grad()
    model.zero_grad_buffer()

    switch = lifecycle.Switch.from_megatron(model, opt, cfg)
    t = time.perf_counter()
    with switch.rollout() as w:
        rollout_bytes = sum(x.numel() * x.element_size() for _, x in w.named_tensors())
    res["first_enter_ms"] = 1e3 * (time.perf_counter() - t)
    walls, inside = [], []
    for _ in range(args.iters):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with switch.rollout(refresh=True):
            pass
        walls.append(1e3 * (time.perf_counter() - t))
        inside.append(1e3 * switch.last_enter[2])
    res["rollout_bytes"] = rollout_bytes
    res["refresh_ms"] = walls
    res["refresh_in_rust_ms"] = inside
    res["refresh_ms_median"] = sorted(walls)[len(walls) // 2]
    res["refresh_in_rust_ms_median"] = sorted(inside)[len(inside) // 2]
    res["stats"] = switch.stats()

    # the naive path: every parameter copied into a separate bf16 rollout model (no fusing)
    named = list(gpt.named_parameters())
    rollout = {n: torch.empty_like(p) for n, p in named}

    def naive():
        with torch.no_grad():
            for n, p in named:
                rollout[n].copy_(p)

    naive()
    ts = []
    for _ in range(args.iters):
        torch.cuda.synchronize()
        t = time.perf_counter()
        naive()
        torch.cuda.synchronize()
        ts.append(1e3 * (time.perf_counter() - t))
    res["naive_copy_ms"] = ts
    res["naive_copy_ms_median"] = sorted(ts)[len(ts) // 2]
    del rollout
    switch.close()
    print(json.dumps(res))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "megatron_enter.json"), "w") as f:
            json.dump(res, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
