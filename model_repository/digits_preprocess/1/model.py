import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Raw 8x8 digit images (pixel values 0-16, as scikit-learn ships them) to the CNN's input."""

    def execute(self, requests):
        out = []
        for r in requests:
            image = pb_utils.get_input_tensor_by_name(r, "IMAGE").as_numpy()
            pixels = (image.astype(np.float32) / 16.0).reshape(image.shape[0], 1, 8, 8)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("PIXELS", pixels)]))
        return out
