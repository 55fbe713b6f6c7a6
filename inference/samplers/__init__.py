"""Where completions come from: the supervised local vLLM (vllm, its key guard vllm_guard, the base model's zero
adapter base_lora), several vLLM replicas behind one gateway (replicas), requests that must run alone (solo_lane), and
Tinker's SamplingClients (tinker). It may import the policy layer and the bottom modules; never the HTTP layer or
app.py. vLLM imports vllm_guard by its dotted path, so this file must import nothing."""
