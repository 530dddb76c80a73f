import sys

from . import worker
from .model import main

worker(sys.argv[2]) if sys.argv[1:2] == ["--worker"] else main()
