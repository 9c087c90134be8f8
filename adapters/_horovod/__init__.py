"""What the Horovod backends share: the runtime (``hvd.init`` with a layout's process sets,
host collectives) and the pipeline executor's framework-free part (rounds, messages, state)."""
