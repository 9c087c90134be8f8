"""torch modules built from the toolkit's model specs (MLP, CNN, GPT), and what a native module
(synchronised BatchNorm, its shardable units) needs."""
