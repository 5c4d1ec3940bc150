"""What runs on the devices: the jitted train and eval steps, heads, gradient
syncs, train state, precision, optimizers, the int8 forward."""
