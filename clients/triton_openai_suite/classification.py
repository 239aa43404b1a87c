"""Why each of Triton's tests fails against our server: (regex on nodeid, class, reason).

Classes (issue 31 "What it must show" allows A1-A4; A5/A6 are added, see docs/triton-openai-tests.md):
  A1 Triton's own limitation (n = 1, no logit_bias, logprobs <= 5)
  A2 FastAPI's 422 bodies (and FastAPI's {"detail": ...} error body; we answer 400 + OpenAI's {"error": {...}})
  A3 Triton's test-repository models (mock_llm, identity_py, tool_stream_py, all-MiniLM-L6-v2)
  A4 a trained model's text (our default model has random weights)
  A5 Triton's own frontend internals: its CLI flags, in-process modules, model load/unload API (not the HTTP API)
  A6 a Triton convention where Triton differs from OpenAI and vLLM (we follow OpenAI/vLLM)
  B  a gap in our server (part N = the issue-31 part expected to fix it)
First matching rule wins; order matters."""
A1, A2, A3, A4, A5, A6 = ("A1 Triton limitation", "A2 FastAPI 422/detail", "A3 Triton test-repo model",
                          "A4 trained model's text", "A5 Triton frontend internals", "A6 Triton convention")
RULES = [
    # --- B: real gaps
    (r"test_openai_client_completion_echo\[True\]|test_completions\.py::.*test_echo\[True\]",
     "B (part 4)", "echo=true answered 400 \"invalid 'echo': not supported\"; wants 200 with text starting with the prompt"),
    (r"test_stream_options_without_streaming",
     "B (part 7)", "stream_options with stream=false answered 200; wants 400 whose message contains \"`stream_options` can only be used when `stream` is True\""),
    (r"test_openai_client\.py::.*test_top_logprobs_requires_logprobs",
     "B (message text)", "400 is right, but the message is 'top_logprobs needs logprobs: true'; the test wants \"`top_logprobs` can only be used when `logprobs` is True\" (frontend/openai_api/protocol.py)"),
    (r"test_observability\.py::.*test_startup_success",
     "B (no part)", "GET /health/ready is 404 (Triton's frontend readiness route; we only have /health)"),
    (r"test_observability\.py::.*test_startup_metrics",
     "A5 Triton frontend internals", "our /metrics has the frontend's own counts and latencies; Triton's frontend "
     "serves Triton's server metrics there ('nv_cpu_utilization'), which ours are on Triton's metrics port"),
    # --- A4: trained model's text
    (r"test_openai_client\.py::.*test_openai_client_(chat_)?completion$",
     A4, "finish_reason 'stop' needs the model to emit EOS within max_tokens (default 16 for completions); a random model runs to 'length' (flaky: passes when EOS happens to be sampled)"),
    (r"test_tool_calling\.py::.*test_tool_call_and_choice",
     A4, "tool_choice=auto: a random model writes no <tool_call> (tool_calls None)"),
    (r"test_tool_calling\.py::.*test_tool_call_with_named_tool_choice",
     A4, "named tool: call, name, schema-valid args and streaming all right (probes.py); args values ('Dallas', 'TX') need a trained model"),
    (r"test_tool_calling\.py::.*test_tool_call_with_required_tool_choice",
     A4, "required: a random model picks the other tool / two calls; a trained model would then still fail on A6: the test wants finish_reason != 'tool_calls', we answer 'tool_calls' as OpenAI and vLLM do"),
    # --- A1: Triton limitations
    (r"sampling_parameters\[logit_bias", A1, "Triton refuses logit_bias (400); we support it (200)"),
    (r"test_chat_completions\.py::.*test_chat_completions_multiple_choices", A1, "Triton supports only n=1 (400); we serve n=2 (200)"),
    (r"test_completions\.py::.*test_completions_multiple_choices\[sampling_parameter_dict[02]\]", A1, "Triton supports only n=1 (400); we serve n=2 (200)"),
    (r"test_completion_logprobs_exceeds_max|test_completions_logprobs_validation", A1, "Triton caps completions logprobs at 5 (422); we allow up to max_logprobs=20 like vLLM (200)"),
    (r"test_completions_logprobs_zero", A6, "Triton treats logprobs=0 as off (None); OpenAI/vLLM return the chosen token's logprob and it as the one top_logprobs entry, as we do since part 4"),
    # --- A2: FastAPI bodies
    (r"invalid_sampling_parameters|test_chat_completions_no_message|test_chat_completions_empty_message|test_chat_completions_top_logprobs_validation|test_chat_top_logprobs_exceeds_max",
     A2, "wants FastAPI's 422; we answer 400 with OpenAI's error naming the field"),
    (r"test_completions_empty_request|test_completions_no_model|test_completions_no_prompt|test_completions\.py::.*test_no_prompt",
     A2, "wants FastAPI's 422; we answer 400 with OpenAI's error naming the field"),
    (r"test_chat_completions_top_logprobs_without_logprobs|test_completions_multiple_choices\[sampling_parameter_dict[13]\]",
     A2, "our 400 is right; the test then reads FastAPI's body key response.json()['detail'] (KeyError: we answer {'error': {...}})"),
    # --- A3: Triton's test-repository models
    (r"test_embeddings\.py::", A3, "model all-MiniLM-L6-v2 from Triton's vllm_embedding_models and its exact vectors; /v1/embeddings is also 404 today (part 5)"),
    (r"test_observability\.py::.*test_models_list", A3, "wants the 2 models of Triton's test_models repo and owned_by 'Triton Inference Server'"),
    (r"test_observability\.py::.*test_models_get", A3, "GET /v1/models/mock_llm (Triton's test model); /v1/models/{id} is also 404 today (part 5)"),
    (r"TestStreamingToolParseLimit", A3, "model tool_stream_py from Triton's tool_parser_models, and Triton's max_tool_call_parse_bytes option"),
    # --- A5: Triton frontend internals
    (r"TestChatCompletionsTokenizers", A5, "builds Triton's frontend in-process with its --tokenizer option (no tokenizer / gpt2 / hf download)"),
    (r"test_model_management\.py::", A5, "starts Triton's frontend with its CLI flags (--model-control-mode, --load-model) on Triton's test_models; load/unload API"),
    (r"test_lora\.py", A5, "imports Triton's openai_frontend.engine.utils.triton; LoRA via Triton's repository layout"),
    (r"test_openai_restricted_apis\.py", A5, "imports Triton's api_restriction middleware; --openai-restricted-api CLI flag"),
    (r"test_request_size\.py", A5, "imports Triton's RequestSizeLimitMiddleware and HTTP_DEFAULT_MAX_INPUT_SIZE; mock_llm (behaviour worth copying for part 8(d): 413 content_too_large)"),
]
