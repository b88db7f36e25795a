"""How much memory a rank needs: model states (parameters, gradients, master weights, optimizer states),
activations and the largest temporary buffers, for any config and layout (`predict`), and the layouts of a
world size ranked by an estimated step time (`dist-llm memory --suggest`).

    estimate.py      the per-rank Estimate, the device its kernels are counted for, the table it prints as
    params.py        which parameters a rank holds, by name and shape (meta-device build, stage, tp piece)
    model_states.py  model states: the ZeRO paper's count (`paper_model_states`) and ours, exactly
    activations.py   what a rank saves for backward (Korthikanti et al. 2022's formulas, and our kernels')
    transients.py    the largest temporary buffer of a step; the build, load and export transients
    peak.py          `predict`: all of the above for the stage that needs the most
    moe.py           the Mixture-of-Experts terms (expert parallelism, routed tokens, all-to-all buffers)
    pipeline.py      what a zero-bubble schedule's held-back W's keep
    comm.py          bytes a rank sends per step, per collective kind (the suggester's cost model)
    suggest.py       `--suggest`: every layout of a world size, counted and ranked

Tests check these counts against the bytes a training rank really holds.
"""

from dist_llm.memory.activations import _layer_bytes, activation_bytes, korthikanti_layer_bytes, our_layer_values
from dist_llm.memory.activations import rms_norm_saves_normalised
from dist_llm.memory.estimate import GB, Estimate, GiB, assumed_device, parse_size, table
from dist_llm.memory.model_states import PAPER_K, model_state_bytes, paper_model_states, zero_buckets
from dist_llm.memory.params import _local_shape, _model_params, _stage_layers, _stage_model, _stage_params
from dist_llm.memory.peak import predict
from dist_llm.memory.transients import init_draw_numel, init_transient_bytes, largest_tensor_numel
from dist_llm.memory.transients import pipelined_zero3_bytes, ring_buffer_bytes, temporary_bytes, transient_bytes

# (the underscored names are the counting's own, re-exported for parallel/data/ and the tests, which read them too)
__all__ = ["GB", "GiB", "PAPER_K", "Estimate", "_layer_bytes", "_local_shape", "_model_params", "_stage_layers",
           "_stage_model", "_stage_params", "activation_bytes", "assumed_device", "init_draw_numel",
           "init_transient_bytes", "korthikanti_layer_bytes", "largest_tensor_numel", "model_state_bytes",
           "our_layer_values", "paper_model_states", "parse_size", "pipelined_zero3_bytes", "predict",
           "ring_buffer_bytes", "rms_norm_saves_normalised", "table", "temporary_bytes", "transient_bytes",
           "zero_buckets"]
