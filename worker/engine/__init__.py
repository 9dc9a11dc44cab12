"""A tiny seeded hybrid-attention reference engine (torch, CPU) used to prove the data path end to end."""
