from .model import main

main()
