"""The options of `vllm serve` in releases before 0.34.0 that 0.34.0 lacks, or took in a form
0.34.0's cannot read: facts (names, arity, releases) read by `vllm_flags_read` from the wheels of
RELEASES, one wheel at a time (its docstring has the commands); no code or help text copied.

One line per option: the names 0.34.0 lacks (or, where only the form changed, the names whose
older arity 0.34.0's cannot read), the arity (as in `vllm_flags_0_34`, widened to read every form
the option had), then the first and the last of RELEASES those names were read in. A flag lives
across many releases, so a few releases from 0.6 to 0.33 cover what launch scripts still carry.
"""

RELEASES = (
    "0.6.0",
    "0.6.6.post1",
    "0.7.3",
    "0.8.5.post1",
    "0.9.2",
    "0.10.2",
    "0.11.2",
    "0.14.1",
    "0.18.1",
    "0.22.1",
    "0.26.0",
    "0.30.0",
    "0.33.0",
)

OPTIONS = """
--prompt-adapters values 0.6.0 0.9.2
--disable-frontend-multiprocessing --no-disable-frontend-multiprocessing switch 0.6.0 0.18.1
--quantization-param-path value 0.6.0 0.6.6.post1
--guided-decoding-backend value 0.6.0 0.10.2
--worker-use-ray switch 0.6.0 0.6.6.post1
--use-v2-block-manager switch 0.6.0 0.9.2
--num-lookahead-slots value 0.6.0 0.11.2
--swap-space value 0.6.0 0.14.1
--rope-scaling json 0.6.0 0.10.2
--rope-theta value 0.6.0 0.10.2
--max-context-len-to-capture value 0.6.0 0.6.0
--max-seq-len-to-capture value 0.6.0 0.10.2
--tokenizer-pool-size value 0.6.0 0.9.2
--tokenizer-pool-type value 0.6.0 0.9.2
--tokenizer-pool-extra-config json 0.6.0 0.9.2
--lora-extra-vocab-size value 0.6.0 0.11.2
--long-lora-scaling-factors values 0.6.0 0.9.2
--enable-prompt-adapter --no-enable-prompt-adapter switch 0.6.0 0.9.2
--max-prompt-adapters value 0.6.0 0.9.2
--max-prompt-adapter-token value 0.6.0 0.9.2
--device value 0.6.0 0.9.2
--num-scheduler-steps value 0.6.0 0.9.2
--scheduler-delay-factor value 0.6.0 0.10.2
--enable-chunked-prefill optional 0.6.0 0.7.3
--speculative-model value 0.6.0 0.7.3
--speculative-model-quantization value 0.6.0 0.7.3
--num-speculative-tokens value 0.6.0 0.7.3
--speculative-draft-tensor-parallel-size -spec-draft-tp value 0.6.0 0.7.3
--speculative-max-model-len value 0.6.0 0.7.3
--speculative-disable-by-batch-size value 0.6.0 0.7.3
--ngram-prompt-lookup-max value 0.6.0 0.7.3
--ngram-prompt-lookup-min value 0.6.0 0.7.3
--spec-decoding-acceptance-method value 0.6.0 0.7.3
--typical-acceptance-sampler-posterior-threshold value 0.6.0 0.7.3
--typical-acceptance-sampler-posterior-alpha value 0.6.0 0.7.3
--disable-logprobs-during-spec-decoding optional 0.6.0 0.7.3
--preemption-mode value 0.6.0 0.10.2
--qlora-adapter-name-or-path value 0.6.0 0.9.2
--disable-async-output-proc switch 0.6.0 0.10.2
--override-neuron-config json 0.6.0 0.9.2
--engine-use-ray switch 0.6.0 0.6.0
--no-disable-log-requests switch 0.10.2 0.14.1
--task value 0.6.6.post1 0.11.2
--logits-processor-pattern value 0.6.6.post1 0.14.1
--disable-mm-preprocessor-cache --no-disable-mm-preprocessor-cache switch 0.6.6.post1 0.11.2
--enable-lora-bias --no-enable-lora-bias switch 0.6.6.post1 0.10.2
--multi-step-stream-outputs optional 0.6.6.post1 0.9.2
--no-multi-step-stream-outputs switch 0.8.5.post1 0.9.2
--speculative-disable-mqa-scorer switch 0.6.6.post1 0.7.3
--override-pooler-config json 0.6.6.post1 0.11.2
-O json 0.6.6.post1 0.11.2
--enable-reasoning --no-enable-reasoning switch 0.7.3 0.9.2
--max-num-partial-prefills value 0.7.3 0.26.0
--max-long-partial-prefills value 0.7.3 0.26.0
--calculate-kv-scales --no-calculate-kv-scales switch 0.7.3 0.26.0
--expand-tools-even-if-tool-choice-none switch 0.9.2 0.9.2
--override-attention-dtype value 0.9.2 0.26.0
--guided-decoding-disable-fallback --no-guided-decoding-disable-fallback switch 0.9.2 0.10.2
--guided-decoding-disable-any-whitespace --no-guided-decoding-disable-any-whitespace switch 0.9.2 0.10.2
--guided-decoding-disable-additional-properties --no-guided-decoding-disable-additional-properties switch 0.9.2 0.10.2
--num-redundant-experts value 0.9.2 0.11.2
--eplb-window-size value 0.9.2 0.11.2
--eplb-step-interval value 0.9.2 0.11.2
--eplb-log-balancedness --no-eplb-log-balancedness switch 0.9.2 0.11.2
--enable-multimodal-encoder-data-parallel --no-enable-multimodal-encoder-data-parallel switch 0.9.2 0.11.2
--cuda-graph-sizes values 0.9.2 0.11.2
--enable-bf16x3-router-gemm --no-enable-bf16x3-router-gemm switch 0.26.0 0.26.0
--enable-mamba-fine-grained-prefix-cache --no-enable-mamba-fine-grained-prefix-cache switch 0.30.0 0.30.0
"""


def options() -> list[tuple[tuple[str, ...], str, str, str]]:
    """(names, arity, first release, last release) per option, in order of first release."""
    rows = []
    for line in OPTIONS.strip().splitlines():
        *names, arity, first, last = line.split()
        rows.append((tuple(names), arity, first, last))
    return rows
