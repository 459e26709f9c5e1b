"""The encodings, a leaf every layer uses: each encoding's spec, its encoder (run inside the step, on the
device, without waiting for it) and its decoder (run by the reader) in one module: `sparse`, `native`,
`packed` (top-k, quantised top-k, sampled; `bits` holds their bit-level pieces), the `stats` record;
`spec` parses the encoding strings users write, `dtypes` names the dtypes a recording holds, `workspace`
keeps the buffers the encoders reuse. Imports nothing of the package but `_lazy`: torch is imported when
first used."""
