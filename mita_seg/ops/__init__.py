"""MiTA operator: pure tensor functions (no mmseg imports)."""
from .blocked import mita_attention_blocked
from .flops import attention_flops, mita_flops
from .fused_cpu import mita_attention_fused_cpu
from .mita import BACKENDS, Backend, check_mita_args, mita_attention, select_backend
from .reference import mita_attention_reference
from .routing import MiTARouting, mita_routing

__all__ = [
    'mita_attention', 'mita_attention_reference', 'mita_attention_blocked', 'mita_attention_fused_cpu',
    'mita_routing',
    'MiTARouting', 'mita_flops', 'attention_flops', 'Backend', 'BACKENDS', 'select_backend',
    'check_mita_args'
]
