//! Block-scaled e4m3 quantisation against PyTorch (fixtures/fp8, made on the device by
//! fixtures/fp8/make_fp8_fixtures.py with `torch.float8_e4m3fn`): every fp8 byte and every
//! block's `scale_inv` bit for bit, over rows and columns that are not multiples of 128, an
//! all-zero block, values at the saturation edge and in the subnormal range, signed zeros and
//! rounding ties.

use std::path::Path;

use lifecycle_layout::fp8::quantize_blocks;
use serde_json::Value;

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

#[test]
fn host_quantisation_is_bit_identical_to_pytorch() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/fp8/fp8_cases.json");
    let refs: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cases = refs["cases"].as_object().unwrap();
    assert_eq!(cases.len(), 5);
    let mut elements = 0;
    for (name, c) in cases {
        let shape = u64s(&c["shape"]);
        let (rows, cols) = (shape[0] as usize, shape[1] as usize);
        let x: Vec<f32> = u64s(&c["input_bits"])
            .into_iter()
            .map(|b| f32::from_bits(b as u32))
            .collect();
        let q = quantize_blocks(name, &x, rows, cols).unwrap();
        let want_scales: Vec<u32> = u64s(&c["scale_inv_bits"])
            .into_iter()
            .map(|b| b as u32)
            .collect();
        let got_scales: Vec<u32> = q.scale_inv().iter().map(|s| s.to_bits()).collect();
        assert_eq!(got_scales, want_scales, "{name}: scale_inv");
        let want: Vec<u8> = u64s(&c["fp8"]).into_iter().map(|b| b as u8).collect();
        if let Some(i) = (0..want.len()).find(|&i| q.data()[i] != want[i]) {
            panic!(
                "{name}: element {i} ({}) is {:#04x}, PyTorch {:#04x}",
                x[i],
                q.data()[i],
                want[i]
            );
        }
        elements += want.len();
    }
    assert_eq!(elements, 87_037, "every element of the five cases");
}
