"""Everything that depends on the installed release of transformers (or torch, safetensors, torchao, TRL),
by subject: the generation loop (`loop`), what a forward and `generate()` return (`outputs`), and the other
libraries (`libraries`). No other module of the package looks at a version number or probes transformers'
internals; they read these facts as `_compat.NAME`, whichever module holds it.
"""

from .libraries import (  # noqa: F401
    TORCHAO_CONFIG_OBJECTS,
    TRL_TESTED,
    errno_in_message,
    read_slice,
    trl_tested,
)
from .loop import (  # noqa: F401
    ACCEPTS_CUSTOM_GENERATE,
    ASSISTED_MODE,
    CONTINUOUS_BATCHING_ENTRIES,
    CRITERIA_ANSWER_PER_ROW,
    DOLA_MODE,
    GROUP_BEAM_MODE,
    HAS_SEPARATE_WARPER_LIST,
    LIST_BUILDERS,
    LOOP_TAPS,
    REFUSES_LOW_MEMORY_BEAM_SEARCH,
    SKIPS_STOPPING_ONCE_ALL_FINISHED,
    SUPPORTED_MODES,
    TRANSFORMERS_VERSION,
    UNSUPPORTED_BECAUSE,
    LogitsProcessorList,
    StoppingCriteriaList,
    Version,
    final_tap_on_warper_list,
    generation_delegates,
    generation_mode,
    loop_taps,
    outputs_kept_on_device,
    own_decoding_loop,
    provisional_generation_config,
    refuses_low_memory_beam_search,
    rows_done,
)
from .outputs import (  # noqa: F401
    CHUNKED_PADDED_FORWARD,
    HF_RAW_LOGITS_EXACT,
    UPCASTS_LOGITS,
    CapturePoint,
    attention_implementations,
    cache_argument,
    cache_of,
    capture_points,
    encoder_of,
    forward_raw_logits,
    logits_to_keep_argument,
    matches,
    output_sequences,
    text_config,
    ties_last_hidden_state,
)
