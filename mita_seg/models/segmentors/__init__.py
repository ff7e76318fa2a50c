from .slim_encoder_decoder import SlimEncoderDecoder

__all__ = ['SlimEncoderDecoder']
