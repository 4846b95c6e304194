"""Weight formats read at load time: quantization schemes and the converters into the packed layout."""
