//! Parameter names and shapes of reference models, for benchmarks and checks.

/// Qwen2.5-7B parameter names and shapes for `layers` decoder layers (hidden 3584, intermediate
/// 18944, vocab 152064, kv dim 512, q/k/v biases, untied head; 28 layers make the real model,
/// 7.615 B parameters).
pub fn qwen2_5_7b(layers: usize) -> Vec<(String, Vec<usize>)> {
    qwen2(layers, 3584, 18944, 152064, 512)
}

/// Qwen2-style parameter names and shapes: `layers` decoder layers of hidden size `h`,
/// intermediate size `i`, vocabulary `v` and key/value width `kv`, with q/k/v biases and an
/// untied head.
pub fn qwen2(layers: usize, h: usize, i: usize, v: usize, kv: usize) -> Vec<(String, Vec<usize>)> {
    let mut t = vec![("model.embed_tokens.weight".to_string(), vec![v, h])];
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        t.push((format!("{p}.input_layernorm.weight"), vec![h]));
        t.push((format!("{p}.self_attn.q_proj.weight"), vec![h, h]));
        t.push((format!("{p}.self_attn.q_proj.bias"), vec![h]));
        t.push((format!("{p}.self_attn.k_proj.weight"), vec![kv, h]));
        t.push((format!("{p}.self_attn.k_proj.bias"), vec![kv]));
        t.push((format!("{p}.self_attn.v_proj.weight"), vec![kv, h]));
        t.push((format!("{p}.self_attn.v_proj.bias"), vec![kv]));
        t.push((format!("{p}.self_attn.o_proj.weight"), vec![h, h]));
        t.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
        t.push((format!("{p}.mlp.gate_proj.weight"), vec![i, h]));
        t.push((format!("{p}.mlp.up_proj.weight"), vec![i, h]));
        t.push((format!("{p}.mlp.down_proj.weight"), vec![h, i]));
    }
    t.push(("model.norm.weight".to_string(), vec![h]));
    t.push(("lm_head.weight".to_string(), vec![v, h]));
    t
}
