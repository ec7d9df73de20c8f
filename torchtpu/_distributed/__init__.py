"""torch.distributed on tpu: the c10d backend "tpu" (see process_group.py).  It is registered
once, by torchtpu_autoload (start-up step 1, torchtpu/_startup.py), whose constructor calls
`_create` once the package has loaded."""


def _create(opts, backend_options=None):
    from .process_group import create
    return create(opts, backend_options)
