import json

import numpy as np
import pytest

from support import QWEN2


@pytest.fixture
def config():
    return dict(QWEN2)


@pytest.fixture
def params(config):
    import lifecycle

    rng = np.random.default_rng(7)
    return [
        (n, rng.standard_normal(s).astype(np.float32))
        for n, s in lifecycle.expected_parameters(json.dumps(config))
    ]
