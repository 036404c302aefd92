use serde_json::Value;

/// Link bandwidths a prediction uses, in GB/s (10^9 bytes per second).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkRates {
    /// Per-rank receive rate between devices (NVLink; an all-gather's bus bandwidth at W = 2).
    pub nvlink_gbps: f64,
    /// Device memory rate for local casts and copies (bytes read + written).
    pub hbm_gbps: f64,
    /// Pinned host → device.
    pub h2d_gbps: f64,
    /// Device → pinned host.
    pub d2h_gbps: f64,
}

impl Default for LinkRates {
    /// The ceilings measured on the project's 2×H200 machine (BENCHMARKS.md, 2026-11-29): NCCL
    /// all-gather receive 290 GB/s at ≥ 2 GB, cast kernel 4100 GB/s, pinned copies 55 GB/s.
    fn default() -> Self {
        LinkRates {
            nvlink_gbps: 290.0,
            hbm_gbps: 4100.0,
            h2d_gbps: 55.0,
            d2h_gbps: 55.0,
        }
    }
}

/// Where the rates came from, for the printout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RatesSource {
    /// The built-in 2×H200 figures.
    Defaults,
    /// A rates file of a previous run.
    File(String),
    /// Given on the command line (possibly over a file).
    Options,
}

impl LinkRates {
    /// Reads rates from JSON: either this type's field names (`nvlink_gbps`, `hbm_gbps`,
    /// `h2d_gbps`, `d2h_gbps`) or a run report's ceilings (`device_to_device_gbps`, `local_gbps`,
    /// `host_to_device_gbps`, `device_to_host_gbps`); missing fields keep their defaults.
    ///
    /// ```
    /// let r = lifecycle_plan::LinkRates::from_json(r#"{"device_to_device_gbps": 250, "h2d_gbps": 25}"#)?;
    /// assert_eq!((r.nvlink_gbps, r.h2d_gbps, r.d2h_gbps), (250.0, 25.0, 55.0));
    /// # Ok::<(), String>(())
    /// ```
    pub fn from_json(text: &str) -> Result<Self, String> {
        let v: Value =
            serde_json::from_str(text).map_err(|e| format!("rates file is not JSON: {e}"))?;
        let obj = v
            .as_object()
            .ok_or("rates file: the top level must be a JSON object")?;
        let mut r = LinkRates::default();
        for (key, field) in [
            ("nvlink_gbps", &mut r.nvlink_gbps as &mut f64),
            ("hbm_gbps", &mut r.hbm_gbps),
            ("h2d_gbps", &mut r.h2d_gbps),
            ("d2h_gbps", &mut r.d2h_gbps),
        ] {
            let alias = match key {
                "nvlink_gbps" => "device_to_device_gbps",
                "hbm_gbps" => "local_gbps",
                "h2d_gbps" => "host_to_device_gbps",
                _ => "device_to_host_gbps",
            };
            if let Some(x) = obj.get(key).or_else(|| obj.get(alias)) {
                let g = x
                    .as_f64()
                    .filter(|g| *g > 0.0 && g.is_finite())
                    .ok_or_else(|| {
                        format!("rates file: `{key}` must be a positive number, found {x}")
                    })?;
                *field = g;
            }
        }
        Ok(r)
    }

    /// The rates as JSON (the format [`LinkRates::from_json`] reads).
    pub fn to_json(&self) -> String {
        serde_json::json!({
            "nvlink_gbps": self.nvlink_gbps,
            "hbm_gbps": self.hbm_gbps,
            "h2d_gbps": self.h2d_gbps,
            "d2h_gbps": self.d2h_gbps,
        })
        .to_string()
    }
}
