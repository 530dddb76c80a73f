"""The reference forwards' view of a GGUF file (cpufuse/reference/archs.py, gptoss.py): every tensor
dequantized by gguf-py to float64 in numpy order, and the metadata values; and their RMS norm."""
import numpy as np


class RefFile:
    def __init__(self, path):
        import gguf
        self.r = gguf.GGUFReader(path)
        self.arch = self.get("general.architecture")
        self.t = {}
        for t in self.r.tensors:
            a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))   # numpy order: (n_out, n_in)
            self.t[t.name] = a.reshape(shape)

    def get(self, key, default=None):
        f = self.r.fields.get(key)
        if f is None:
            return default
        if len(f.data) == 1 and f.types[0] != 9:   # a scalar (9 = array)
            v = f.parts[f.data[0]]
            if f.types[0] == 8:                    # string
                return bytes(v).decode()
            return v[0].item()
        return [f.parts[i][0].item() if f.types[-1] != 8 else bytes(f.parts[i]).decode() for i in f.data]

    def a(self, key, default=None):
        return self.get(f"{self.arch}.{key}", default)


def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w
