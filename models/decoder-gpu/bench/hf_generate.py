"""PyTorch baseline for the GPU decoder's throughput test: Hugging Face transformers `generate`
on a random Qwen2.5-0.5B-shaped model (the same shape as `decode_throughput_qwen05b_batch64` in
tests/gpu.rs), bf16 weights, one GPU, batch 64, prompt 32, greedy, 128 new tokens.

Run on the GPU machine (PyTorch + transformers installed):
    python3 models/decoder-gpu/bench/hf_generate.py
"""
import time

import torch
import transformers
from transformers import Qwen2Config, Qwen2ForCausalLM

BATCH, PROMPT, NEW = 64, 32, 128


def main():
    cfg = Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, rope_theta=1e6, rms_norm_eps=1e-6,
        tie_word_embeddings=True, max_position_embeddings=4096,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, PROMPT), device="cuda")
    mask = torch.ones_like(ids)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.cuda.get_device_name()}")
    for attn in ["eager", "sdpa"]:
        cfg._attn_implementation = attn
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("cuda"):
            model = Qwen2ForCausalLM(cfg).eval()
        torch.set_default_dtype(torch.float32)
        params = sum(p.numel() for p in model.parameters())
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8,
                           do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW,
                                 min_new_tokens=NEW, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
            secs = time.perf_counter() - t
        new = (out.shape[1] - PROMPT) * BATCH
        print(f"HF generate ({attn} attention): {params / 1e9:.2f} B params, batch {BATCH}, "
              f"prompt {PROMPT}, {out.shape[1] - PROMPT} new tokens (greedy): {secs:.3f} s incl. "
              f"prefill, {new / secs:.0f} tokens/s", flush=True)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
