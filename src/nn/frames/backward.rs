//! The frame encoder's backward written out ([`crate::nn::by_hand`]): the frames are data, so
//! only the parameters' gradients are computed. With r the ReLU's input and m the maximum over
//! a pooling window's four corners y_c,
//!
//!   ∂r = ∂out ⊙ [r ≥ 0],   ∂bias = Σ ∂r,   ∂y_c = ∂r ⊙ [y_c = m],
//!   ∂W = ∂Y Pᵀ,   ∂P = Wᵀ ∂Y   (P the patches, gathered by `ops::RowGather`),
//!
//! the masks as candle's autograd takes them (a ReLU passes the gradient at 0; every corner
//! equal to the maximum receives it), so that training is the same with either backward; the
//! dense layers' are ∂W = ∂yᵀ x, ∂b = Σ_rows ∂y, ∂x = ∂y W. Each product is one op
//! ([`crate::ops::gemm`]), on the layouts the forward left.

use candle_core::{Result, Tensor};

use super::{ConvPass, ConvPool, FrameEncoder, Pass, Weights, CHANNELS, HIDDEN};
use crate::nn::by_hand::{by_hand_on_data, GradSink, ParamsBackward};
use crate::ops::{gemm, Mat};

impl FrameEncoder {
    /// [`FrameEncoder::forward_timed`] as one node of candle's graph whose backward is written
    /// by hand: the parameters' gradients go to `sink`. Where the fused ops do not cover the
    /// frames (dtype, device) or the frames need a gradient, the ordinary forward.
    pub fn forward_by_hand(
        &self,
        x: &Tensor,
        dt: Option<&Tensor>,
        sink: &GradSink,
    ) -> Result<Tensor> {
        if x.track_op() || !self.conv1.index.fused(x) {
            return self.forward_timed(x, dt);
        }
        let (batch, len, _) = x.dims3()?;
        let w = self.weights(true);
        let pass = self.run(&x.detach(), dt.map(Tensor::detach).as_ref(), &w, true)?;
        let y = pass.out.clone();
        let back = EncoderBackward {
            vars: [
                self.conv1.weight.clone(),
                self.conv1.bias.clone(),
                self.conv2.weight.clone(),
                self.conv2.bias.clone(),
            ],
            dense_vars: [self.dense1.clone(), self.dense2.clone()],
            convs: [self.conv1.clone(), self.conv2.clone()],
            frames: batch * len,
            pass,
            w,
        };
        by_hand_on_data(x, &y, &self.conv1.weight, Box::new(back), sink)
    }
}

/// What the forward kept (detached), and the parameters it ran on.
struct EncoderBackward {
    /// The convolutions' weights and biases (the gradients' keys).
    vars: [Tensor; 4],
    /// The dense layers as built (their parameters are the gradients' keys).
    dense_vars: [candle_nn::Linear; 2],
    convs: [ConvPool; 2],
    frames: usize,
    pass: Pass,
    w: Weights,
}

/// The ReLU's gradient as candle's autograd takes it: ∂x = ∂y ⊙ [x ≥ 0].
fn relu_backward(x: &Tensor, g: &Tensor) -> Result<Tensor> {
    g.mul(&x.ge(0.0)?.to_dtype(g.dtype())?)
}

/// A dense layer y = x Wᵀ + b: (∂W, ∂b) and, if asked, ∂x, from ∂y (rows, out).
fn dense_backward(
    x: &Mat,
    w: &Tensor,
    g: &Tensor,
    with_dx: bool,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    let (rows, outs) = g.dims2()?;
    let ins = w.dim(1)?;
    let dw = gemm(&Mat::rows(g)?.t(), x, (outs, ins))?;
    let db = g.sum(0)?;
    let dx = match with_dx {
        true => Some(gemm(&Mat::rows(g)?, &Mat::rows(w)?, (rows, ins))?),
        false => None,
    };
    Ok((dw, db, dx))
}

impl ConvPool {
    /// (∂weight, ∂bias) and, if asked, ∂x (in_c, side, side, n) from ∂out.
    fn backward(
        &self,
        pass: &ConvPass,
        weight: &Tensor,
        g: &Tensor,
        with_dx: bool,
    ) -> Result<(Tensor, Tensor, Option<Tensor>)> {
        let n = g.dim(3)?;
        let (cols, cells) = (self.k * self.k * self.in_c, self.pooled * self.pooled);
        let dpre = relu_backward(&pass.pre, &g.reshape((CHANNELS, 1, cells * n))?)?;
        let dbias = dpre.sum((1, 2))?;
        let dcorners = pass
            .corners
            .broadcast_eq(&pass.max)?
            .to_dtype(g.dtype())?
            .broadcast_mul(&dpre)?;
        let dcorners = Mat::matrix(&dcorners, 4 * cells * n)?;
        let dweight = gemm(
            &dcorners,
            &Mat::rows(&pass.patches)?.t(),
            (CHANNELS, self.in_c, self.k, self.k),
        )?;
        if !with_dx {
            return Ok((dweight, dbias, None));
        }
        let dpatches = gemm(
            &Mat::matrix(weight, cols)?.t(),
            &dcorners,
            (self.index.len(), n),
        )?;
        let (p, padded) = (self.padding, self.side + 2 * self.padding);
        let dx = self
            .index
            .backward(&dpatches)?
            .reshape((self.in_c, padded, padded, n))?
            .narrow(1, p, self.side)?
            .narrow(2, p, self.side)?
            .contiguous()?;
        Ok((dweight, dbias, Some(dx)))
    }
}

impl ParamsBackward for EncoderBackward {
    fn backward(&self, dy: &Tensor) -> Result<Vec<(Tensor, Tensor)>> {
        let n = self.frames;
        let [dense1, dense2] = &self.w.dense;
        let Some([conv1, conv2]) = &self.pass.conv else {
            candle_core::bail!("frame encoder: the forward kept nothing for the backward");
        };
        let g = dy.reshape((n, ()))?;
        let (dw2, db2, dread) =
            dense_backward(&Mat::rows(&self.pass.read)?, dense2.weight(), &g, true)?;
        let dread = dread.expect("asked for");
        let dhidden = relu_backward(&self.pass.hidden, &dread.narrow(1, 0, HIDDEN)?)?;
        // The first dense layer read the second convolution's maps (channels · cells, n)
        // transposed.
        let maps = Mat::matrix(&self.pass.maps, n)?.t();
        let (dw1, db1, _) = dense_backward(&maps, dense1.weight(), &dhidden, false)?;
        let dmaps = gemm(
            &Mat::rows(dense1.weight())?.t(),
            &Mat::rows(&dhidden)?.t(),
            self.pass.maps.shape().clone(),
        )?;
        let [[_, _], [cw2, _]] = &self.w.conv;
        let (dcw2, dcb2, dmaps1) = self.convs[1].backward(conv2, cw2, &dmaps, true)?;
        let dmaps1 = dmaps1.expect("asked for");
        let [[cw1, _], _] = &self.w.conv;
        let (dcw1, dcb1, _) = self.convs[0].backward(conv1, cw1, &dmaps1, false)?;
        let [vw1, vb1, vw2, vb2] = self.vars.clone();
        let mut grads = vec![(vw1, dcw1), (vb1, dcb1), (vw2, dcw2), (vb2, dcb2)];
        for (layer, (dw, db)) in self.dense_vars.iter().zip([(dw1, db1), (dw2, db2)]) {
            grads.push((layer.weight().clone(), dw));
            match layer.bias() {
                Some(b) => grads.push((b.clone(), db)),
                None => candle_core::bail!("frame encoder: a dense layer without its bias"),
            }
        }
        Ok(grads)
    }
}
