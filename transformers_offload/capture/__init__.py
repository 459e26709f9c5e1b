"""What runs inside `generate()`: the hooks on the model, the capture of each step, the layer taps,
and the ring that moves each step off the device. Uses `store`; never `read` or the recorder."""
