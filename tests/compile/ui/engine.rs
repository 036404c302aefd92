// Shared by the UI cases with an engine (`include!`d after `copying.rs`): a KV cache of one slot
// per weight, allocated on wake and freed on sleep.

#[derive(Default)]
struct Kv {
    cache: Vec<f32>,
}

impl Kv {
    fn touch(&mut self) -> f32 {
        self.cache.iter().sum()
    }
}

impl lifecycle_core::RolloutEngine<Vec<f32>> for Kv {
    type Error = std::convert::Infallible;

    fn wake(
        &mut self,
        weights: lifecycle_core::RolloutView<'_, Vec<f32>>,
        _: &mut lifecycle_core::PhaseScope,
    ) -> Result<(), Self::Error> {
        self.cache = vec![0.0; weights.len()];
        Ok(())
    }
    fn sleep(&mut self, _: &mut lifecycle_core::PhaseScope) -> Result<(), Self::Error> {
        self.cache = Vec::new();
        Ok(())
    }
    fn memory(&self) -> lifecycle_core::EngineBytes {
        lifecycle_core::EngineBytes::device(4 * self.cache.len() as u64)
    }
}
