"""Model helpers under the names scripts written for the reference
implementation import (``roundpipe.models.function``)."""
