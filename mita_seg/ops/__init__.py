"""MiTA operator: pure tensor functions (no mmseg imports)."""
from .agent import agent_attention
from .bias import RelPosBias
from .block import block_attention
from .blocked import mita_attention_blocked
from .dispatch import AUTO_ORDER, BACKENDS, Backend, Inputs, select_backend
from .flops import (agent_flops_per_head, attention_flops, bias_flops_per_head,
                    block_flops_per_head, global_flops_per_head, mita_flops_per_head,
                    topk_flops_per_head, window_flops_per_head)
from .fused_cpu import mita_attention_fused_cpu
from .kinds import attend, operator_of
from .mita import check_mita_args, mita_attention, mita_flops
from .reference import mita_attention_reference
from .routing import MiTARouting, mita_routing
from .topk import topk_attention
from .varlen import mita_attention_varlen
from .window import window_attention

__all__ = [
    'mita_attention', 'mita_attention_reference', 'mita_attention_blocked',
    'mita_attention_fused_cpu', 'mita_attention_varlen', 'mita_routing', 'MiTARouting',
    'mita_flops', 'mita_flops_per_head', 'attention_flops', 'Backend', 'BACKENDS', 'Inputs',
    'AUTO_ORDER', 'select_backend', 'check_mita_args', 'RelPosBias', 'bias_flops_per_head',
    'global_flops_per_head', 'agent_attention', 'block_attention', 'topk_attention',
    'window_attention', 'agent_flops_per_head', 'block_flops_per_head', 'topk_flops_per_head',
    'window_flops_per_head', 'attend', 'operator_of'
]
