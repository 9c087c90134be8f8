"""TensorFlow forward passes of the toolkit's model specs (MLP, CNN, GPT) and native Keras 3
models (their variables under neutral names, synchronised BatchNorm)."""
