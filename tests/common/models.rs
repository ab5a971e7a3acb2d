//! Small models the integration tests share.

use myosotis::nn::*;

/// A classifier of two features in, H 6, two blocks of `layer`, dropout 0.1, four classes
/// (pre-norm with BatchNorm, post-norm with LayerNorm).
pub fn classifier(
    layer: SeqLayerConfig,
    activation: Activation,
    norm: NormKind,
    pooling: Pooling,
) -> ClassifierConfig {
    ClassifierConfig {
        encoder: EncoderConfig::Linear { features: 2 },
        d_model: 6,
        layers: 2,
        layer,
        norm,
        prenorm: norm == NormKind::Batch,
        activation,
        dropout: 0.1,
        pooling,
        classes: 4,
        timing: Default::default(),
        pairs: false,
        decoder: Default::default(),
        seed: 0,
        bn_momentum: BN_MOMENTUM,
        dense_init: Default::default(),
    }
}
