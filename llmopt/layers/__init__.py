"""Building blocks of the decoder: norm, rotary embedding, attention math, sampler."""
