from typing import Any

ShardedStateDict = dict[str, Any]
