"""Integrations of losshead with model libraries.

    from losshead.integrations.transformers import offload_lm_head

Each submodule imports its library only when it is used, so importing them never needs the
library installed. `causal_lm` holds the library-free part: a causal language model made of a
`.model` trunk that returns hidden states and an `.lm_head` linear layer over it (the layout of
Hugging Face's *ForCausalLM classes) has its head moved to a losshead server.
"""
