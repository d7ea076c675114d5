"""The on-data certificate: the paper's trajectory bound (T) on a real batch (docs/theory.md sections 5 and 6).

The worst-case certificate holds for every input in a ball and is far above what happens on data.
:func:`trajectory` evaluates the backward chain along the batch's actual states,

    log ||p_0|| <= log ||p_D|| + sum_k log(||P_k|| + dt ||Dv_k(X_k)||),

with the forward side (largest state norm and intermediate), and reports the headroom to the dtype's largest
finite value in nats.  Layout: :mod:`.power` (Lanczos estimates from below, dense certified bounds),
:mod:`.sources` (the states and segments of a model on the batch from its own updates), :mod:`.graph` (the
same from its captured graph), :mod:`.report` (the figures), :mod:`.api` (``trajectory``), :mod:`.watch` (the
monitor's on-data checks and alerts).
"""

from .api import trajectory
from .power import SpectralEstimate, dense_jacobian_norm, jacobian_spectral_norm
from .report import QUANTITIES, HeadTrajectory, TrajectoryReport, UpdateTrajectory

__all__ = ["trajectory", "TrajectoryReport", "UpdateTrajectory", "HeadTrajectory", "QUANTITIES",
           "SpectralEstimate", "jacobian_spectral_norm", "dense_jacobian_norm"]
