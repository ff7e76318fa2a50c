"""mmseg's ``EncoderDecoder`` with the same results from lighter slide inference and
post-processing, and its dense attention on PyTorch's fused path."""
from typing import List, Sequence, Tuple

import torch
import torch.nn.functional as F
from mmengine.structures import PixelData
from torch import Tensor

from mmseg.models.segmentors import EncoderDecoder
from mmseg.models.utils import resize
from mmseg.registry import MODELS
from mmseg.structures import SegDataSample
from mmseg.utils import OptSampleList, SampleList

from ..fast_attention import check_dense_attn, set_dense_attn


def runs(mask: Sequence[bool]) -> List[Tuple[int, int]]:
    """``[start, end)`` of each run of True in ``mask``."""
    out, start = [], None
    for i, m in enumerate(list(mask) + [False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


@MODELS.register_module()
class SlimEncoderDecoder(EncoderDecoder):
    """``EncoderDecoder`` whose ``slide_inference`` and ``postprocess_result`` return the
    very same seg logits and class maps as mmseg's (bit for bit) with far less work on large
    logits (150 classes at full image size):

    - slide inference adds each crop's logits in place into its window of the full-size
      sum, instead of adding a zero-padded full-size copy per crop (``F.pad``); a window's
      part no earlier crop covered is written (``0 + x``) rather than added to zeros, so
      the sum is not zero-filled first; the division by the crop count runs only where a
      pixel has more than one crop (``x / 1 == x``);
    - post-processing skips the bilinear resize to ``ori_shape`` where the logits already
      have that size and are finite (a resize to the same size is the identity on finite
      values; a non-finite value would spread into its neighbours, so then it runs), and
      takes the class map from ``max(dim=0)``'s indices (``argmax``'s, first maximum on
      ties, NaN first, at less cost).

    The crops, their order, each crop's forward and resize (``encode_decode``) and the order
    of the sums are mmseg's, so the results are equal, not close. Training and whole-image
    inference are ``EncoderDecoder``'s. Build it with ``type='SlimEncoderDecoder'`` in
    place of ``'EncoderDecoder'`` (same arguments, same checkpoint keys); mita_seg's tools
    do so for ``EncoderDecoder`` configs unless the config says ``slim_inference=False``
    (:func:`mita_seg.apis.use_slim_inference`).

    Its dense global attention (mmcv ``MultiheadAttention``: the ViT family, Segmenter's
    mask head) runs on PyTorch's fused path by default (``dense_attn='fast'``,
    :func:`~mita_seg.models.set_dense_attn`): mmseg's results to float32 rounding, not bit
    for bit; ``dense_attn='mmseg'`` keeps mmseg's path, and with it mmseg's results bit for
    bit.

    Args:
        dense_attn (str): ``'fast'`` (``F.scaled_dot_product_attention``, the ``N x N``
            weights never formed) or ``'mmseg'`` (mmseg's own path). Default: 'fast'.
        **kwargs: the arguments of ``EncoderDecoder``.
    """

    def __init__(self, dense_attn: str = 'fast', **kwargs):
        check_dense_attn(dense_attn)
        super().__init__(**kwargs)
        set_dense_attn(self, dense_attn)

    def slide_inference(self, inputs: Tensor, batch_img_metas: List[dict]) -> Tensor:
        """mmseg's ``slide_inference`` (same crops, same order, same sums and division),
        in place.

        Args:
            inputs (Tensor): images ``[N, C, H, W]``.
            batch_img_metas (List[dict]): image meta info; the first one's ``img_shape``
                is set to each crop's shape in turn (as mmseg does).

        Returns:
            Tensor: the seg logits ``[N, out_channels, H, W]``, averaged over the crops.
        """
        h_stride, w_stride = self.test_cfg.stride
        h_crop, w_crop = self.test_cfg.crop_size
        batch_size, _, h_img, w_img = inputs.size()
        h_grids = max(h_img - h_crop + h_stride - 1, 0) // h_stride + 1
        w_grids = max(w_img - w_crop + w_stride - 1, 0) // w_stride + 1
        # With strides at most the crop, each row of crops covers the full width and the
        # rows cover [0, y2 of the last row so far): what an earlier crop covered is known,
        # and the rest of a window is written rather than added to zeros.
        tiled = h_stride <= h_crop and w_stride <= w_crop
        preds = (inputs.new_empty if tiled else inputs.new_zeros)(
            (batch_size, self.out_channels, h_img, w_img))
        count_mat = inputs.new_zeros((1, 1, h_img, w_img))
        row_count = [0] * h_img         # crops over each row, over each column
        col_count = [0] * w_img
        rows_end = 0                    # the rows [0, rows_end) are covered
        for h_idx in range(h_grids):
            cols_end = 0                # in this row of crops, the columns [0, cols_end)
            for w_idx in range(w_grids):
                y1 = h_idx * h_stride
                x1 = w_idx * w_stride
                y2 = min(y1 + h_crop, h_img)
                x2 = min(x1 + w_crop, w_img)
                y1 = max(y2 - h_crop, 0)
                x1 = max(x2 - w_crop, 0)
                crop_img = inputs[:, :, y1:y2, x1:x2]
                # change the image shape to patch shape
                batch_img_metas[0]['img_shape'] = crop_img.shape[2:]
                logit = self.encode_decode(crop_img, batch_img_metas)
                if torch.promote_types(logit.dtype, preds.dtype) == preds.dtype:
                    # widened exactly, once, as the sum would (bf16 logits under autocast):
                    # same values, and the sums below run on one dtype (much faster)
                    logit = logit.to(preds.dtype)
                window = preds[:, :, y1:y2, x1:x2]
                if tiled:
                    top = min(max(rows_end - y1, 0), y2 - y1)   # rows covered above
                    left = min(max(cols_end - x1, 0), x2 - x1)  # columns covered left
                    window[:, :, :top] += logit[:, :, :top]
                    window[:, :, top:, :left] += logit[:, :, top:, :left]
                    # the rest: 0 + x, as mmseg's sum has it (-0.0 becomes 0.0); out= is
                    # not differentiable, so with autograd on through a temporary
                    rest = logit[:, :, top:, left:]
                    if rest.requires_grad:
                        window[:, :, top:, left:] = rest + 0.0
                    else:
                        torch.add(rest, 0.0, out=window[:, :, top:, left:])
                    cols_end = x2
                else:
                    window += logit
                count_mat[:, :, y1:y2, x1:x2] += 1
                if h_idx == 0:
                    col_count[x1:x2] = [c + 1 for c in col_count[x1:x2]]
            row_count[y1:y2] = [c + 1 for c in row_count[y1:y2]]
            rows_end = y2
        assert (count_mat == 0).sum() == 0
        if not tiled:
            return preds.div_(count_mat)
        # x / 1 == x: divide only where more than one crop added up. A pixel's count is its
        # row's times its column's (a grid of crops): those pixels are bands of rows (all
        # columns) and bands of columns (in the other rows).
        many_rows = [c > 1 for c in row_count]
        for y1, y2 in runs(many_rows):
            preds[:, :, y1:y2].div_(count_mat[:, :, y1:y2])
        single_rows = runs([not m for m in many_rows])
        for x1, x2 in runs([c > 1 for c in col_count]):
            for y1, y2 in single_rows:
                preds[:, :, y1:y2, x1:x2].div_(count_mat[:, :, y1:y2, x1:x2])
        return preds

    def postprocess_result(self, seg_logits: Tensor,
                           data_samples: OptSampleList = None) -> SampleList:
        """mmseg's ``postprocess_result`` (padding removed, flip undone, resized to
        ``ori_shape``, class map), without the resize where it is the identity and with the
        class map from ``max``'s indices. Binary heads (``out_channels == 1``, thresholded
        sigmoid) take mmseg's own.

        Args:
            seg_logits (Tensor): ``[N, C, H, W]`` from ``inference``.
            data_samples (list[SegDataSample], optional): their meta info; None returns
                new samples holding the logits as they are.

        Returns:
            list[SegDataSample]: with ``seg_logits`` and ``pred_sem_seg``.
        """
        batch_size, C, H, W = seg_logits.shape
        if C == 1:
            return super().postprocess_result(seg_logits, data_samples)
        only_prediction = data_samples is None
        if only_prediction:
            data_samples = [SegDataSample() for _ in range(batch_size)]
        for i in range(batch_size):
            if only_prediction:
                i_seg_logits = seg_logits[i]
            else:
                img_meta = data_samples[i].metainfo
                # remove padding area
                if 'img_padding_size' not in img_meta:
                    padding_size = img_meta.get('padding_size', [0] * 4)
                else:
                    padding_size = img_meta['img_padding_size']
                left, right, top, bottom = padding_size
                i_seg_logits = seg_logits[i:i + 1, :, top:H - bottom, left:W - right]
                if img_meta.get('flip', None):
                    direction = img_meta.get('flip_direction', None)
                    assert direction in ['horizontal', 'vertical']
                    i_seg_logits = i_seg_logits.flip(
                        dims=(3, ) if direction == 'horizontal' else (2, ))
                i_seg_logits = self.resize_logits(i_seg_logits, img_meta['ori_shape'])
                i_seg_logits = i_seg_logits.squeeze(0)
            data_samples[i].set_data({
                'seg_logits': PixelData(**{'data': i_seg_logits}),
                'pred_sem_seg': PixelData(**{'data': i_seg_logits.max(dim=0, keepdim=True)[1]})
            })
        return data_samples

    def resize_logits(self, logits: Tensor, size: Sequence[int]) -> Tensor:
        """mmseg's ``resize(logits, size, 'bilinear', self.align_corners)``; where
        ``logits`` already have that size and are all finite, the same values without the
        resize (a contiguous tensor of the dtype the resize would give under autocast)."""
        size = tuple(int(s) for s in size)
        if tuple(logits.shape[2:]) != size or not torch.isfinite(logits.sum()):
            return resize(logits, size=size, mode='bilinear',
                          align_corners=self.align_corners, warning=False)
        # the dtype F.interpolate gives here (autocast may run it in another one): the
        # conversion to it is what the resize's identity would have done
        probe = F.interpolate(logits.new_zeros((1, 1, 1, 1)), size=(1, 1), mode='bilinear',
                              align_corners=self.align_corners)
        return logits.to(probe.dtype).contiguous()
