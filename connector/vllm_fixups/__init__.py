"""Where vLLM needs a nudge for hybrid prefix caching: start-up settings (``engine_config``) and
the CPU platform plugin (``cpu_compat``). Each fix states the upstream behaviour it corrects."""
