"""The swap study's statistics over training seeds: a mean and its sample standard deviation,
a row's number as ``mean ± std``, and two rows' difference paired by seed. A leaf: it imports
nothing of the study (rows are plain dicts, as :mod:`.rows` makes them and the JSON holds
them)."""
from statistics import mean, stdev
from typing import Sequence, Tuple

__all__ = ['mean_std', 'pm', 'paired']


def mean_std(values: Sequence[float]) -> Tuple[float, float]:
    """The mean and the sample standard deviation (n - 1; 0 for one value)."""
    return mean(values), stdev(values) if len(values) > 1 else 0.0


def pm(r: dict, key: str, sign: str = '') -> str:
    """``r[key]`` as ``mean ± std`` where the row is over seeds (``std``), else the value."""
    text = f'{r[key]:{sign}.2f}'
    std = r.get('std', {}).get(key)
    return text if std is None or r.get('seeds', 1) < 2 else f'{text} ± {std:.2f}'


def paired(a: dict, b: dict) -> str:
    """Row ``a``'s mIoU minus row ``b``'s, seed by seed: mean ± sample std, and on how many
    seeds ``a`` is ahead."""
    sa, sb = (r.get('per_seed', {}).get('mIoU', {}) for r in (a, b))
    diffs = [sa[k] - sb[k] for k in sa if k in sb] or [a['mIoU'] - b['mIoU']]
    avg, std = mean_std(diffs)
    return (f'{avg:+.2f} ± {std:.2f} (ahead on {sum(d > 0 for d in diffs)} of '
            f'{len(diffs)} seeds)')
