import pytest

# Bucket sizes in bytes of fp32 gradients.
SIZES = {"1MB": 1_000_000, "25MB": 25_000_000, "100MB": 100_000_000}


@pytest.fixture(params=list(SIZES), ids=list(SIZES))
def bucket_bytes(request):
    return request.param, SIZES[request.param]
